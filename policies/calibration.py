"""How far admission's TTFT predictions miss, learnt from the requests it admitted.

Admission (:mod:`policies.admission`) predicts a request's TTFT from a linear step-time
model and the replica's queue. On the 2-core host of issue #26 that model was pessimistic
for the requests it admitted (measured / predicted TTFT: median 0.71, largest 1.27 over 68
requests), so a fixed margin of 0.85 of the budget refused long prompts that vLLM served
within the SLO. Instead of a fixed margin, the ingress records, for each admitted
request, the seconds from admission to its first token against the prediction it was
admitted on, and admission plans with a high quantile of that error: a prediction is
taken to fit when ``predicted + error quantile <= budget``. An error in seconds rather than
a ratio: a short prompt predicted at 0.1 s that lands one step late has a ratio of 2 but
an error of one step, which is what matters against a budget of seconds.

Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections import deque

ERROR_QUANTILE = 0.9
"""Quantile of the TTFT error planned with: the 90% attainment that goodput counts
(DistServe, Zhong et al., OSDI 2024)."""


class TtftCalibration:
    """The ``quantile`` of measured minus predicted TTFT over the last ``window`` admitted
    requests, in seconds.

    Args:
        quantile: in (0, 1).
        window: observations kept (recent ones, so it follows the host's drift).
        min_samples: observations needed before :meth:`error_s` answers; before that it
            is None and admission keeps its fixed ``slo_margin``.

    Raises:
        ValueError: ``quantile`` outside (0, 1), ``window`` < 1 or ``min_samples`` outside
            [1, window].
    """

    def __init__(self, quantile: float = ERROR_QUANTILE, window: int = 64,
                 min_samples: int = 16) -> None:
        if not 0 < quantile < 1 or window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"quantile={quantile!r}, window={window!r}, "
                             f"min_samples={min_samples!r}: need 0 < quantile < 1 and "
                             "1 <= min_samples <= window")
        self.quantile = quantile
        self.min_samples = min_samples
        self._errors: deque[float] = deque(maxlen=window)
        self._cached: float | None = None

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """Record one admitted request: its predicted and measured TTFT, both counted from
        the moment it was admitted. Non-finite values are ignored."""
        if math.isfinite(predicted_s) and math.isfinite(measured_s):
            self._errors.append(measured_s - predicted_s)
            self._cached = None

    @property
    def samples(self) -> int:
        return len(self._errors)

    def error_s(self) -> float | None:
        """Seconds to add to a TTFT prediction (negative: the model is pessimistic); None
        before ``min_samples`` observations."""
        if len(self._errors) < self.min_samples:
            return None
        if self._cached is None:
            ranked = sorted(self._errors)
            self._cached = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
        return self._cached
