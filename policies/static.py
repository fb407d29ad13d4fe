"""Static batching: the baseline that iteration-level scheduling is measured against.

A batch of up to ``max_num_seqs`` requests is formed, runs until every member has
finished, and only then is the next batch formed: the request-level batching of
conventional inference servers that Orca (Yu et al., OSDI 2022, section 2.2) contrasts
with iteration-level scheduling. Requests that arrive meanwhile wait for the next batch,
and the batch's seats stay empty as its short members finish.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import R


class StaticBatchPolicy:
    """Admit whole batches in arrival order; admit nothing while a batch runs.

    A batch forms when ``max_num_seqs`` requests wait, or when the oldest waiting request
    has waited ``batch_wait_timeout_s`` seconds (then with whatever is waiting). Members
    may be admitted over several steps when the token budget or KV room limits prefill.

    Forming a batch needs the waiting requests in order, which :meth:`may_admit` is not
    given: :meth:`order` records its input whenever no batch is active (nothing runs then,
    so a non-empty input is the waiting queue; the scheduler orders the waiting queue right
    before it calls ``may_admit``).

    Args:
        max_num_seqs: requests per batch at most (the engine's ``max_num_seqs``).
        batch_wait_timeout_s: seconds, from the oldest waiting request's arrival, to wait
            for a full batch before starting a partial one.

    Raises:
        ValueError: ``max_num_seqs`` < 1 or ``batch_wait_timeout_s`` < 0.
    """

    by_priority = False
    max_head_of_line_skips = 0

    def __init__(self, max_num_seqs: int, batch_wait_timeout_s: float = 0.5) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r}: must be >= 1")
        if not (math.isfinite(batch_wait_timeout_s) and batch_wait_timeout_s >= 0):
            raise ValueError(f"batch_wait_timeout_s={batch_wait_timeout_s!r}: must be >= 0")
        self.max_num_seqs = max_num_seqs
        self.batch_wait_timeout_s = float(batch_wait_timeout_s)
        self._batch: set[str] = set()
        """Ids of the current batch's members that have not finished; empty: no batch."""
        self._candidates: list[R] = []
        """The waiting queue in arrival order, as last seen by ``order`` with no batch."""

    @property
    def batch(self) -> frozenset[str]:
        """Ids of the running batch's unfinished members (empty between batches)."""
        return frozenset(self._batch)

    def order(self, requests: Sequence[R], now: float) -> list[R]:
        ordered = sorted(requests, key=lambda r: r.arrival_time)
        if not self._batch and ordered:
            self._candidates = ordered
        return ordered

    def may_admit(self, request: R, num_running: int, num_waiting: int, now: float) -> bool:
        """Between batches: whether a batch forms now and ``request`` is in it.

        During a batch: whether ``request`` is a member. The scheduler asks only about
        waiting requests, so a member asked about has not been admitted yet (or was
        preempted and must come back).
        """
        if not self._batch:
            candidates = self._candidates
            if all(r.request_id != request.request_id for r in candidates):
                # order() was not called on the queue holding ``request``: fall back to
                # what we know rather than admit requests we have not seen.
                candidates = [request]
            full = max(num_waiting, len(candidates)) >= self.max_num_seqs
            timed_out = now - candidates[0].arrival_time >= self.batch_wait_timeout_s
            if not (full or timed_out):
                return False
            self._batch = {r.request_id for r in candidates[: self.max_num_seqs]}
            self._candidates = []
        return request.request_id in self._batch

    def pick_victim(self, running: Sequence[R]) -> R:
        """The latest arrival. Static batching needs no preemption when the KV cache can
        hold a whole batch at full length; if it cannot, the member recomputed is the one
        that arrived last, and it is re-admitted as a member of the same batch."""
        return max(running, key=lambda r: r.arrival_time)

    def preempts(self, waiting: R, running: R, now: float) -> bool:
        return False

    def outranks(self, a: R, b: R) -> bool:
        return False

    def on_admit(self, request: R, now: float) -> None:
        pass

    def on_finish(self, request: R) -> None:
        """``request`` left the engine; the batch ends when its last member does."""
        self._batch.discard(request.request_id)
        # An aborted waiting request must not be put into the next batch.
        self._candidates = [r for r in self._candidates if r.request_id != request.request_id]
