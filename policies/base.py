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
    """Decides what runs next; the scheduler supplies the mechanism.

    The scheduler calls, each step: ``order`` on the running requests (to serve decodes
    most urgent first) and on the waiting ones (to admit); ``pick_victim`` when KV blocks
    run out; ``may_admit`` before admitting a waiting request and ``on_admit`` after;
    ``preempts`` when the head of the waiting order is blocked by ``max_num_seqs`` or KV
    room; ``outranks`` in the TPOT guard, for a running decode's precedence over other
    requests; ``on_finish`` when a request leaves.
    """

    by_priority: bool
    """Whether it serves requests in priority order (less urgent work neither delays a
    request nor keeps it from preempting): what admission's latency model assumes
    (:class:`policies.admission.AdmissionController`)."""

    max_head_of_line_skips: int
    """How many later requests may be admitted past a head that lacks KV room before the
    scheduler stops admitting, so that blocks free up for the head (0: strict order)."""

    def order(self, requests: Sequence[R], now: float) -> list[R]:
        """``requests`` most urgent first.

        Args:
            requests: waiting requests (new and preempted) or running ones.
            now: the current time in seconds, on the engine's clock.
        """
        ...

    def pick_victim(self, running: Sequence[R]) -> R:
        """The running request to preempt (by recompute); ``running`` is non-empty."""
        ...

    def preempts(self, waiting: R, running: R, now: float) -> bool:
        """Whether blocked ``waiting`` may preempt ``running`` to take its place."""
        ...

    def outranks(self, a: R, b: R) -> bool:
        """Whether ``a``'s latency SLO comes before ``b``'s whatever either has waited:
        ``b`` yields step time to ``a`` (the scheduler's TPOT guard sheds ``b``'s decode,
        or caps ``b``'s prompt, for ``a``'s decode). Unlike :meth:`preempts` it does not
        age, because the running request it is asked about has stopped waiting."""
        ...

    def may_admit(self, request: R, num_running: int, num_waiting: int, now: float) -> bool:
        """Whether ``request``, next in ``order``, may start now.

        Args:
            num_running: requests running before this step's admissions.
            num_waiting: requests waiting, this one included.
        """
        ...

    def on_admit(self, request: R, now: float) -> None:
        """``request`` left the waiting queue to run (also on re-admission after a
        preemption)."""
        ...

    def on_finish(self, request: R) -> None:
        """``request`` left the engine (finished or aborted)."""
        ...
