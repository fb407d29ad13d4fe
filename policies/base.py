"""The interface between the engine's scheduler and a scheduling policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Schedulable(Protocol):
    """What a policy may read of a request (the engine's ``Request`` satisfies it)."""

    request_id: str
    arrival_time: float
    """Seconds on the engine's clock; kept across preemption."""
    priority: int
    """Lower is more urgent, as in vLLM."""


R = TypeVar("R", bound=Schedulable)


class SchedulingPolicy(Protocol):
    """Decides what runs next; the scheduler supplies the mechanism."""

    def order(self, waiting: Sequence[R], now: float) -> list[R]:
        """The waiting requests in the order they should be admitted.

        Args:
            waiting: requests not running (new and preempted).
            now: the current time in seconds, on the engine's clock.
        """
        ...

    def pick_victim(self, running: Sequence[R]) -> R:
        """The running request to preempt when KV blocks run out.

        Args:
            running: a non-empty sequence of running requests.
        """
        ...
