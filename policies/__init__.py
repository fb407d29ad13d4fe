"""Scheduling and admission policies: pure Python, no torch.

A policy orders the waiting requests and picks preemption victims; the engine's
scheduler calls it and never branches on a policy's name.
"""

from policies.base import SchedulingPolicy
from policies.fcfs import FCFSPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    """Build the policy registered as ``name``.

    Raises:
        ValueError: no policy has that name.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None


__all__ = ["POLICIES", "FCFSPolicy", "SchedulingPolicy", "make_policy"]
