"""Scheduling and admission policies: pure Python, no torch.

A policy orders the waiting requests and picks preemption victims; the engine's
scheduler calls it and never branches on a policy's name. ``policies.admission`` decides,
at the router, whether a replica should take a request at all, from the replica's
``policies.load.LoadSnapshot`` and the step-time model of ``policies.step_time``;
``policies.prediction_log`` scores its predictions.
"""

from collections.abc import Callable, Mapping
from typing import Any

from policies.admission import AdmissionController
from policies.base import SchedulingPolicy
from policies.decision import Admit, Decision, Prediction, Reject, Wait
from policies.fcfs import FCFSPolicy
from policies.load import LoadSnapshot
from policies.prediction_log import PredictionLog
from policies.priority import (
    DEFAULT_CLASS,
    DEFAULT_CLASSES,
    PriorityPolicy,
    TrafficClass,
    make_classes,
)
from policies.static import StaticBatchPolicy
from policies.step_time import StepTimeModel

POLICIES: dict[str, Callable[..., SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "static": StaticBatchPolicy,
}


def make_policy(name: str, **options: Any) -> SchedulingPolicy:
    """Build the policy registered as ``name``, passing ``options`` to its constructor.

    ``"static"`` needs ``max_num_seqs`` (the engine's); ``"priority"`` takes
    ``aging_s_per_level`` and ``max_head_of_line_skips``.

    Raises:
        ValueError: no policy has that name.
    """
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(**options)


def policy_from_spec(spec: Mapping[str, Any] | None) -> SchedulingPolicy | None:
    """The policy a ``{"name": ..., "options": {...}}`` spec names
    (``EngineConfig.policy_spec``: JSON, as Serve's router arguments must be); None: None.

    Raises:
        ValueError: no policy has that name.
    """
    return None if spec is None else make_policy(spec["name"], **spec.get("options", {}))


__all__ = [
    "DEFAULT_CLASS",
    "DEFAULT_CLASSES",
    "POLICIES",
    "AdmissionController",
    "Admit",
    "Decision",
    "FCFSPolicy",
    "LoadSnapshot",
    "Prediction",
    "PredictionLog",
    "PriorityPolicy",
    "Reject",
    "SchedulingPolicy",
    "StaticBatchPolicy",
    "StepTimeModel",
    "TrafficClass",
    "Wait",
    "make_classes",
    "make_policy",
    "policy_from_spec",
]
