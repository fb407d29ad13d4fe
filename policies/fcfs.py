"""First come, first served."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import R


class FCFSPolicy:
    """Admit in arrival order; preempt the latest arrival (it has waited least).

    Strict head of line: a later request never overtakes a head that lacks KV room.
    """

    by_priority = False
    max_head_of_line_skips = 0

    def order(self, requests: Sequence[R], now: float) -> list[R]:
        return sorted(requests, key=lambda r: r.arrival_time)

    def pick_victim(self, running: Sequence[R]) -> R:
        return max(running, key=lambda r: r.arrival_time)

    def preempts(self, waiting: R, running: R, now: float) -> bool:
        return False

    def outranks(self, a: R, b: R) -> bool:
        return False

    def may_admit(self, request: R, num_running: int, num_waiting: int, now: float) -> bool:
        return True

    def on_admit(self, request: R, now: float) -> None:
        pass

    def on_finish(self, request: R) -> None:
        pass
