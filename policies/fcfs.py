"""First come, first served."""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import R


class FCFSPolicy:
    """Admit in arrival order; preempt the latest arrival (it has waited least)."""

    def order(self, waiting: Sequence[R], now: float) -> list[R]:
        return sorted(waiting, key=lambda r: r.arrival_time)

    def pick_victim(self, running: Sequence[R]) -> R:
        return max(running, key=lambda r: r.arrival_time)
