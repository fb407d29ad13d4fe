"""Admission at the ingress: ``policies.admission`` applied to every replica's latest load.

A request is admitted as soon as one replica would take it within its class's SLOs
(the router then picks between two replicas by predicted TTFT). While no replica would,
it is held and re-decided as new snapshots arrive, for at most its class's
``max_queue_wait_s`` or until its TTFT SLO is out of reach (``AdmissionController.decide``);
then a rejectable class gets 429 with a Retry-After, and the batch class keeps waiting (it
is refused only at its hard queue cap).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import Counter
from collections.abc import Callable, Mapping

from policies import (
    AdmissionController,
    Admit,
    Decision,
    LoadSnapshot,
    Reject,
    SchedulingPolicy,
    TrafficClass,
)

POLL_S = 0.05
"""Seconds between re-decisions of a held request (snapshots refresh about every 0.1 s)."""


class AdmissionRejected(Exception):
    """Answer 429: no replica can take the request within its SLO now."""

    def __init__(self, retry_after_s: float, reason: str, kind: str = "ttft") -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.kind = kind
        """``policies.Reject.kind``: a bounded label for metrics."""


def computed_tokens(prompt_tokens: int, snaps: list[tuple[LoadSnapshot, int]]) -> int:
    """The prompt tokens a request would compute on the replica that holds least of its
    prompt in its prefix cache (``snaps``: ``(snapshot, cached tokens)`` per replica).

    A held request counts as queued ahead of later arrivals at every replica, so it
    counts what it costs where it costs most, not its whole prompt: with a shared system
    prompt cached everywhere, its prefill is only the rest."""
    return prompt_tokens - min((cached for _, cached in snaps), default=0)


class IngressAdmission:
    """Holds or refuses requests that no replica could serve within their SLOs.

    Args:
        classes: traffic classes by name.
        policy: the replicas' scheduling policy (None: the priority policy).
        enabled: False admits everything at once (admission off).
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(
        self,
        classes: Mapping[str, TrafficClass],
        *,
        policy: SchedulingPolicy | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = AdmissionController(classes, policy=policy)
        self.enabled = enabled
        self.clock = clock
        self._held: dict[int, tuple[str, float, int]] = {}
        """Requests held now: a token -> (class, arrival, prompt tokens to compute)."""
        self._admitted: set[int] = set()
        """Tokens of held requests already admitted, on their way to a replica's queue."""
        self._tokens = itertools.count()
        self._index: tuple[list[float], list[dict[str, tuple[int, int]]]] | None = None
        """Arrival times of the held requests still deciding, sorted, and per-class totals
        before each, the admitted ones' included (:meth:`_ahead`); None: rebuild."""

    @property
    def held(self) -> dict[str, int]:
        """Requests held at this ingress now, per class."""
        return dict(Counter(cls for cls, _, _ in self._held.values()))

    def held_arrivals(self) -> dict[str, list[float]]:
        """Per class, the arrival times (on ``clock``) of the requests held here now."""
        out: dict[str, list[float]] = {}
        for cls, arrival_s, _ in self._held.values():
            out.setdefault(cls, []).append(arrival_s)
        return out

    async def admit(
        self,
        loads: Callable[[], list[tuple[LoadSnapshot, int]]],
        traffic_class: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        arrival_s: float,
        token: int | None = None,
    ) -> float:
        """Return once the request may go to a replica; the seconds it was held.

        Args:
            loads: the replicas' current snapshots (re-read at every decision), each with
                the tokens of this prompt that replica is expected to hold in its prefix
                cache (they are not computed again); empty when none has reported yet,
                which admits (the router then balances on queue lengths).
            arrival_s: when the request arrived, on ``clock``.
            token: the request's hold (:meth:`hold`), which the caller releases once the
                replica has queued the request, so that the decisions made meanwhile count
                it; None: held here and released on return.

        Raises:
            AdmissionRejected: refuse with 429 and ``retry_after_s``.
        """
        if not self.enabled:
            return 0.0
        own = token is None
        if token is None:
            token = self.hold(traffic_class, arrival_s, prompt_tokens)
        held_for: str | None = None  # why it was first held, for the 429 message
        try:
            while True:
                snaps = loads()
                if not snaps:
                    break
                self.recount(token, computed_tokens(prompt_tokens, snaps))
                d = self.decide(
                    snaps, traffic_class, prompt_tokens, max_tokens, priority, arrival_s
                )
                if isinstance(d, Admit):
                    self._admit_hold(token)
                    break
                if isinstance(d, Reject):
                    reason = d.reason
                    if held_for is not None:
                        # After a long hold the last failure is often only that the
                        # budget ran out; the first says what held it.
                        reason += (
                            f" (held {self.clock() - arrival_s:.1f} s; first held "
                            f"because {held_for})"
                        )
                    raise AdmissionRejected(d.retry_after_s, reason, d.kind)
                if held_for is None:
                    held_for = d.reason
                await asyncio.sleep(POLL_S)
        finally:
            if own:
                self.release(token)
        return max(0.0, self.clock() - arrival_s)

    def hold(self, traffic_class: str, arrival_s: float, prompt_tokens: int) -> int:
        """Count a request as held here (queued ahead of later arrivals) until
        :meth:`release` with the returned token."""
        token = next(self._tokens)
        self._held[token] = (traffic_class, arrival_s, prompt_tokens)
        self._index = None
        return token

    def recount(self, token: int, tokens: int) -> bool:
        """Count held request ``token`` as ``tokens`` prompt tokens from now on (what a
        replica would compute of it: :func:`computed_tokens`); True if that changed."""
        cls, arrival_s, old = self._held[token]
        if tokens == old:
            return False
        self._held[token] = (cls, arrival_s, tokens)
        self._index = None
        return True

    def release(self, token: int) -> None:
        """End hold ``token``; releasing it again does nothing."""
        self._admitted.discard(token)
        if self._held.pop(token, None) is None:
            return
        self._index = None

    def _admit_hold(self, token: int) -> None:
        """Count held request ``token`` as queued ahead of every decision from now on,
        earlier arrivals' included, until :meth:`release`: it is on its way to a replica,
        whose snapshot does not show it yet. Counted by arrival alone, an admitted later
        arrival was invisible to an earlier one decided meanwhile, and a simultaneous
        burst could take one seat more than there were."""
        if token in self._held and token not in self._admitted:
            self._admitted.add(token)
            self._index = None

    def decide(
        self,
        snaps: list[tuple[LoadSnapshot, int]],
        traffic_class: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        arrival_s: float,
    ) -> Decision:
        """One decision over every replica's load (``(snapshot, cached tokens)`` pairs):
        Admit when any replica admits, Reject (the soonest retry) when all reject, else
        the first replica's Wait. The caller holds the request meanwhile (:meth:`hold`)."""
        waited = max(0.0, self.clock() - arrival_s)
        decisions = [
            self.controller.decide(
                self._with_held(s, arrival_s),
                traffic_class,
                prompt_tokens - cached,
                max_tokens,
                priority,
                waited,
            )
            for s, cached in snaps
        ]
        for d in decisions:
            if isinstance(d, Admit):
                return d
        if all(isinstance(d, Reject) for d in decisions):
            return min(decisions, key=lambda d: d.retry_after_s)
        return decisions[0]

    def _with_held(self, snap: LoadSnapshot, arrival_s: float) -> LoadSnapshot:
        """Count the requests held here since before this one, and the admitted ones not
        yet queued at a replica, as queued ahead of it.

        Only earlier arrivals of those still held: counting every held request would make
        held requests block each other for ever. Conservative across replicas: each
        replica counts all of them, as any may go there, each with the prompt tokens that
        the replica caching least of it would compute (:meth:`recount`).
        """
        return snap.with_queued_totals(self._ahead(arrival_s))

    def _ahead(self, arrival_s: float) -> dict[str, tuple[int, int]]:
        """Held requests that arrived before ``arrival_s``, and every admitted one still
        held: per class, (requests, prompt tokens). From running totals over the held
        requests in arrival order, rebuilt only when the held set changes: every held
        request is re-decided 20 times a second, and summing the held set each time grows
        with its square."""
        if self._index is None:
            admitted: dict[str, tuple[int, int]] = {}
            waiting = []
            for token, (cls, t, n) in self._held.items():
                if token in self._admitted:
                    count, tokens = admitted.get(cls, (0, 0))
                    admitted[cls] = (count + 1, tokens + n)
                else:
                    waiting.append((t, cls, n))
            waiting.sort()
            totals: list[dict[str, tuple[int, int]]] = [admitted]
            for _, cls, n in waiting:
                row = dict(totals[-1])
                count, tokens = row.get(cls, (0, 0))
                row[cls] = (count + 1, tokens + n)
                totals.append(row)
            self._index = ([t for t, _, _ in waiting], totals)
        times, totals = self._index
        return totals[bisect.bisect_left(times, arrival_s)]
