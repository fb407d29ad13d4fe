"""An engine step's time, split by its own record (:class:`engine.StepRecord`): the
scheduler, the runner's ``prepare`` / ``forward`` / ``sample`` phases, and the rest of the
step (request updates, detokenizing, outputs). What :mod:`bench.step_profile` and
:mod:`bench.gpu_check` report per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import StepRecord

PHASES = ("schedule", "prepare", "forward", "sample")
"""The parts of a step measured: ``StepRecord.schedule_s`` and the runner's phases."""


def split_ms(records: Sequence[StepRecord]) -> dict[str, float]:
    """Mean milliseconds per step over ``records``: the whole ``step``, each of
    :data:`PHASES`, and ``other`` (the step less its phases).

    Raises:
        ZeroDivisionError: ``records`` is empty.
    """
    n = len(records)
    out = {"step": 1000 * sum(r.seconds for r in records) / n}
    out["schedule"] = 1000 * sum(r.schedule_s for r in records) / n
    for name in PHASES[1:]:
        out[name] = 1000 * sum(dict(r.phases).get(name, 0.0) for r in records) / n
    out["other"] = out["step"] - sum(out[k] for k in PHASES)
    return out
