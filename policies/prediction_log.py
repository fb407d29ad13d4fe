"""Admission's predictions against what happened: the error of the TTFT predictions.

Pure Python, no torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class PredictionLog:
    """Predicted against measured TTFT, to check the admission model on real traffic.

    Args:
        maxlen: pairs kept (the most recent); None: all.
    """

    def __init__(self, maxlen: int | None = 10_000) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def record(self, predicted_ttft_s: float, actual_ttft_s: float) -> None:
        self._pairs.append((float(predicted_ttft_s), float(actual_ttft_s)))

    def __len__(self) -> int:
        return len(self._pairs)

    def mean_absolute_error(self) -> float:
        """Mean of ``|predicted - actual|`` in seconds; NaN when empty."""
        if not self._pairs:
            return math.nan
        return statistics.fmean(abs(p - a) for p, a in self._pairs)

    def median_relative_error(self) -> float:
        """Median of ``|predicted - actual| / actual`` over pairs with actual > 0; NaN if none."""
        rel = [abs(p - a) / a for p, a in self._pairs if a > 0]
        return statistics.median(rel) if rel else math.nan

    def summary(self) -> dict[str, float]:
        return {
            "count": float(len(self)),
            "mae_s": self.mean_absolute_error(),
            "median_rel_error": self.median_relative_error(),
        }
