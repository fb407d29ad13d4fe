"""One replica's engine-step counts for Prometheus: step time, tokens per step, preemptions.

:class:`StepMetrics` is fed as a step listener of :class:`engine.LLMEngine`, one call per
step, in the replica's process. Its cumulative counts are plain numbers: they travel with
the load snapshot that the ingress reads from every replica (``record_routing_stats``), and
the ingress renders them (:func:`router.metrics.replica_families`) under the names
``iterserve:step_time_seconds``, ``iterserve:iteration_tokens_total`` and
``iterserve:num_preemptions``. Each histogram carries its bucket bounds, so the ingress
renders it without this module (and without the engine's imports).
"""

from __future__ import annotations

import bisect
from typing import Any

from engine.core.interfaces import StepRecord

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
"""Seconds per engine step."""
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Tokens per engine step (prefill tokens; decodes, one per running sequence)."""


class Buckets:
    """A cumulative histogram as plain numbers (it crosses processes as JSON)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_dict(self) -> dict[str, Any]:
        """``{"bounds": upper bounds, "counts": per bucket, the last +Inf, "sum"}``."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class StepMetrics:
    """One replica's step counts, fed as an ``LLMEngine`` step listener (one call per step).

    :meth:`to_dict` is what the replica adds to its routing stats under ``"metrics"``.
    """

    def __init__(self) -> None:
        self.step_s = Buckets(STEP_BUCKETS)
        self.prefill_tokens = Buckets(TOKEN_BUCKETS)
        self.decode_tokens = Buckets(TOKEN_BUCKETS)
        self.preemptions = 0

    def record(self, step: StepRecord) -> None:
        """Count one step."""
        self.step_s.observe(step.seconds)
        if step.num_prefill_tokens:
            self.prefill_tokens.observe(step.num_prefill_tokens)
        if step.num_decodes:
            self.decode_tokens.observe(step.num_decodes)
        self.preemptions += len(step.preempted)

    def to_dict(self) -> dict[str, Any]:
        """``{"step_s", "prefill_tokens", "decode_tokens"}`` (:meth:`Buckets.to_dict`) and
        ``"preemptions"`` (a count)."""
        return {
            "step_s": self.step_s.to_dict(),
            "preemptions": self.preemptions,
            "prefill_tokens": self.prefill_tokens.to_dict(),
            "decode_tokens": self.decode_tokens.to_dict(),
        }
