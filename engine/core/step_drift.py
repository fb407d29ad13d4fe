"""The digital twin's drift on a live replica: its predicted step times against the measured.

The simulator (``iterserve simulate``) costs each step with a step-time model
(:class:`engine.core.step_cost.LinearCost`). A model calibrated on one host, one load or one
build stops predicting another's steps; :class:`DriftMonitor` tells how far, as the
replica serves. Fed every step the engine runs (one of
:attr:`engine.LLMEngine.step_listeners`), it predicts each step's seconds from its
composition (:meth:`engine.core.step_cost.StepShape.of_record`) and measures its period, as the
step log does (:attr:`engine.core.step_log.LoggedStep.period`): from its start to the next
step's start, or its own ``seconds`` where more than :data:`engine.core.step_log.IDLE_GAP_S`
of idleness follows. Per step kind (``decode``, ``mixed``, ``prefill``:
:data:`engine.core.step_log.STEP_KINDS`) over the last ``window_s`` seconds it reports
``sum(predicted) / sum(measured)``: 1 is a perfect twin, below 1 the twin is optimistic
(real steps take longer), above 1 pessimistic.

The model is the one given (a file from ``iterserve calibrate``), or, without one, a fit
(:func:`engine.core.step_cost.fit_linear`) on the replica's own first steps, which then tells
how the replica drifts from how it ran when it started.

The replica renders :meth:`DriftMonitor.to_dict` into its routing stats; the ingress
exports it as ``iterserve:step_time_prediction_ratio`` (:func:`router.metrics.replica_families`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from engine.core.interfaces import StepRecord
from engine.core.step_cost import CostModel, LinearCost, StepShape, fit_linear
from engine.core.step_log import IDLE_GAP_S, STEP_KINDS, step_kind

WINDOW_S = 60.0
"""Seconds of steps the ratio covers."""
FIT_STEPS = 400
"""Steps a monitor without a model fits its own on."""
WARMUP_STEPS = 5
"""First steps left out of a self-fit (compilation, cold caches)."""


class DriftMonitor:
    """Predicted against measured step seconds, per step kind, over a sliding window.

    :meth:`step` runs on the engine's thread once per step and costs a prediction and a
    few additions (the self-fit, once, solves a least-squares problem over ``fit_steps``
    steps); :meth:`ratios` and :meth:`to_dict` may run on another thread.

    Args:
        cost: the twin's step-time model; None: fit one on the first ``fit_steps`` steps
            after ``warmup_steps``, and report nothing until then.
        fit_steps: steps a self-fit uses (at least the model's five features).
        warmup_steps: first steps a self-fit leaves out.
        window_s: seconds of steps (by their start) that :meth:`ratios` covers.
        clock: the engine's clock (seconds), which stamps :attr:`StepRecord.start`.

    Raises:
        ValueError: ``fit_steps`` under five, a negative ``warmup_steps``, or a
            ``window_s`` not positive.
    """

    def __init__(
        self,
        cost: CostModel | None = None,
        *,
        fit_steps: int = FIT_STEPS,
        warmup_steps: int = WARMUP_STEPS,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fit_steps < 5 or warmup_steps < 0 or window_s <= 0:
            raise ValueError(
                f"fit_steps {fit_steps} (at least 5), warmup_steps {warmup_steps} "
                f"(at least 0), window_s {window_s} (positive)"
            )
        self.cost = cost
        self.fit_steps, self.warmup_steps, self.window_s = fit_steps, warmup_steps, window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: tuple[StepRecord, float | None] | None = None
        """The last step and its prediction (None: a step for the self-fit), waiting for
        the next to measure its period."""
        self._seen = 0
        self._fit_shapes: list[StepShape] = []
        self._fit_seconds: list[float] = []
        self._window: deque[tuple[float, str, float, float]] = deque()
        """(start, kind, predicted, measured) of settled steps, oldest first."""
        self._sums = {k: [0.0, 0.0, 0] for k in STEP_KINDS}
        """Per kind: predicted and measured seconds and steps in :attr:`_window`."""

    @property
    def fitted(self) -> bool:
        """Whether the monitor has a model to predict with (given, or fitted by now)."""
        return self.cost is not None

    def step(self, r: StepRecord) -> None:
        """Take one step (a listener of the engine's steps); the previous one's period is
        now known."""
        with self._lock:
            if self._pending is not None:
                prev, predicted = self._pending
                gap = r.start - (prev.start + prev.seconds)
                self._settle(prev, predicted, prev.seconds + gap if 0 <= gap < IDLE_GAP_S else None)
            self._seen += 1
            if self.cost is None and self._seen <= self.warmup_steps:
                self._pending = None
                return
            shape = StepShape.of_record(r.seqs, r.num_decodes)
            if self.cost is None:
                self._pending = (r, None)
                self._fit_shapes.append(shape)
            else:
                self._pending = (r, self.cost.step_seconds(shape))

    def _settle(self, r: StepRecord, predicted: float | None, period: float | None) -> None:
        """``r`` measured ``period`` (None: its own seconds, idleness followed)."""
        measured = r.seconds if period is None else period
        if predicted is None:
            self._fit_seconds.append(measured)
            if len(self._fit_seconds) >= self.fit_steps:
                self._fit()
            return
        kind = step_kind(r.num_prefill_tokens, r.num_decodes)
        self._window.append((r.start, kind, predicted, measured))
        s = self._sums[kind]
        s[0] += predicted
        s[1] += measured
        s[2] += 1
        self._expire(r.start)  # bounded even where nobody reads the ratios

    def _fit(self) -> None:
        # Steps too short to time (a coarse or fake clock) have no relative error.
        pairs = [(x, t) for x, t in zip(self._fit_shapes, self._fit_seconds) if t > 0]
        self._fit_shapes, self._fit_seconds = [], []
        try:
            coef = fit_linear([x for x, _ in pairs], [t for _, t in pairs])
        except ValueError:  # too few timed steps, or a degenerate solve (LinAlgError)
            return  # start over on the next steps: a failure must not stop the engine
        # KV capacity and limits unknown here (0): this model costs steps, nothing more.
        self.cost = LinearCost(
            coef, 0, 0, 0, 0, source=f"fitted by the replica on {len(pairs)} of its first steps"
        )

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._window and self._window[0][0] < horizon:
            _, kind, predicted, measured = self._window.popleft()
            s = self._sums[kind]
            s[2] -= 1
            # Exact zeros once a kind's steps are gone, whatever the rounding left.
            s[0], s[1] = (s[0] - predicted, s[1] - measured) if s[2] else (0.0, 0.0)

    def ratios(self, now: float | None = None) -> dict[str, tuple[float | None, int]]:
        """Per kind (every one of :data:`engine.core.step_log.STEP_KINDS`): ``(sum of predicted
        / sum of measured seconds, steps)`` over the steps that started in the last
        ``window_s`` seconds before ``now`` (default: the clock's now); the ratio is None
        where the kind had no step. The last step counts once idleness after it shows
        (its own seconds) or the next step starts."""
        now = self.clock() if now is None else now
        with self._lock:
            if self._pending is not None:
                prev, predicted = self._pending
                if now - (prev.start + prev.seconds) >= IDLE_GAP_S:
                    self._pending = None
                    self._settle(prev, predicted, None)
            self._expire(now)
            return {k: (p / m if n and m > 0 else None, n) for k, (p, m, n) in self._sums.items()}

    def to_dict(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """:meth:`ratios` as plain JSON: ``{kind: {"ratio": float or None, "steps": int}}``
        (what the replica's routing stats carry as ``"step_time_prediction"``)."""
        return {k: {"ratio": r, "steps": n} for k, (r, n) in self.ratios(now).items()}

    def attach(self, engine) -> None:
        """Take ``engine``'s steps (an :class:`engine.LLMEngine`): a step listener after
        those added before."""
        engine.add_step_listener(self.step)
