"""The router's decisions without Ray: which of two replicas, and what was routed since.

:class:`router.request_router.LoadAwareRouter` (inside Ray Serve) and the simulator
(:mod:`deploy.sim`) both call these, so what the simulator predicts is what the router
does. The method is in :mod:`router.routing`.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from policies import AdmissionController, LoadSnapshot
from router.contract import RequestShape
from router.prefix import PrefixMap, cached_tokens

R = TypeVar("R")

ROUTED_MEMORY_S = 5.0
"""Seconds a routed request is remembered when no newer snapshot has counted it."""
COLD_LORA_LOAD_S = 0.1
"""Seconds a LoRA adapter's read from disk is taken to add to a request's TTFT on a
replica that has read none yet (``LoadSnapshot.lora_load_s`` once it has)."""


@dataclass(frozen=True, slots=True)
class Routed:
    time_s: float
    """When routed, on the snapshots' clock."""
    shape: RequestShape
    matched_blocks: int = 0
    """Leading blocks of the prompt the replica was sent before (:class:`PrefixMap`), so
    likely holds: they are not queued as prefill work there."""


class RoutedSince:
    """What was routed to each replica, to count as queued there until a snapshot has.

    Times are whatever clock the snapshots' ``timestamp`` uses (``time.time()`` in Serve).
    Not thread-safe: the router calls it under its lock.
    """

    def __init__(self) -> None:
        self._routed: dict[Hashable, deque[Routed]] = {}

    def record(
        self, replica: Hashable, now: float, shape: RequestShape, matched_blocks: int = 0
    ) -> None:
        """``shape`` was routed to ``replica`` at ``now``; ``matched_blocks``: leading
        blocks of its prompt the prefix map said ``replica`` was sent before (read before
        recording this request's own prefix)."""
        self._routed.setdefault(replica, deque()).append(Routed(now, shape, matched_blocks))

    def adjust(self, replica: Hashable, snap: LoadSnapshot, now: float) -> LoadSnapshot:
        """``snap`` with the requests routed to ``replica`` since it was taken as queued,
        each with only the prompt tokens it will compute there (a request that follows
        its prefix to this replica would otherwise count its whole prompt, and make the
        replica holding the prefix look busier than an idle one)."""
        routed = self._routed.get(replica, ())
        while routed and routed[0].time_s < min(snap.timestamp, now - ROUTED_MEMORY_S):
            routed.popleft()
        return snap.with_queued(
            (
                r.shape.traffic_class,
                r.shape.prompt_tokens
                - cached_tokens(r.matched_blocks, snap.block_size, r.shape.prompt_tokens),
            )
            for r in routed
            if r.time_s >= snap.timestamp
        )

    def forget(self, replica: Hashable) -> None:
        self._routed.pop(replica, None)


class ReplicaChooser:
    """Power of two choices: first a replica with room for the request's TPOT SLO, then
    the lower predicted TTFT, with prefix affinity as the tie-breaker
    (:meth:`first_is_better`). A request for a LoRA adapter that neither of the pair holds
    lets a replica that holds it compete, and its TTFT on a replica that must read the
    adapter first includes that read (``LoadSnapshot.lora_load_s``).

    Args:
        admission: predicts a request's TTFT on a replica's snapshot and the TPOT SLO it
            must meet there; its ``slo_margin`` is the room the TPOT rule leaves.
        rng: draws the pair (seeded in the simulator; None: a generator seeded by the OS).
    """

    def __init__(self, admission: AdmissionController, rng: random.Random | None = None) -> None:
        self.admission = admission
        self.rng = rng or random.Random()
        self.prefixes = PrefixMap()
        """Which replicas were sent which prompt prefixes (:mod:`router.prefix`)."""

    def choose(
        self,
        candidates: Sequence[R],
        shape: RequestShape,
        snapshot: Callable[[R], LoadSnapshot | None],
        key: Callable[[R], Hashable],
    ) -> list[list[R]]:
        """Ranks of replicas to try, best first (one replica per rank).

        ``snapshot`` gives a replica's adjusted load (None: it has not published one: the
        pair is returned as drawn, for Ray Serve's queue-length choice); ``key`` its id in
        the prefix map.
        """
        if not candidates:
            return []
        pair = self.rng.sample(list(candidates), min(2, len(candidates)))
        matched = self.prefixes.matched_blocks(shape.prefix_hashes)
        # A replica that was sent a longer prefix of this prompt competes with the pair.
        affine = max(candidates, key=lambda r: matched.get(key(r), 0))
        if matched.get(key(affine), 0) > max(matched.get(key(r), 0) for r in pair):
            pair = [affine, *(r for r in pair if r is not affine)][:2]
        if len(pair) == 1:
            return [pair]
        adapter = shape.lora.name if shape.lora is not None else None
        if adapter is not None and not any(_holds(snapshot(r), adapter) for r in pair):
            warm = [r for r in candidates if _holds(snapshot(r), adapter)]
            if warm:
                pair = [self.rng.choice(warm), pair[0]]
        keys = []
        for r in pair:
            snap = snapshot(r)
            if snap is None:
                return [pair]
            cached = cached_tokens(matched.get(key(r), 0), snap.block_size, shape.prompt_tokens)
            pred = self.admission.predict(
                snap, shape.traffic_class, shape.prompt_tokens - cached, shape.priority
            )
            ttft = pred.ttft_s
            if adapter is not None and adapter not in snap.loras:
                ttft += snap.lora_load_s or COLD_LORA_LOAD_S
            load = snap.total_running + sum(snap.waiting_requests.values())
            # Every request it holds decodes once its prompt is in, and so will this one.
            tpot = snap.step_time(0, min(load + 1, snap.max_num_seqs))
            keys.append(
                (
                    tpot <= self.admission.slo_margin * pred.tpot_slo_s,
                    tpot,
                    ttft,
                    load,
                    snap.step_time(0, snap.total_running + 1),
                    (adapter is None or adapter in snap.loras, cached),
                )
            )
        first, second = pair if self.first_is_better(*keys) else pair[::-1]
        # The other replica stays as a second rank, used if the first refuses (full queue).
        return [[first], [second]]

    @staticmethod
    def first_is_better(key0: tuple, key1: tuple) -> bool:
        """Whether the first of two replicas, keyed ``(TPOT fits, predicted TPOT,
        predicted TTFT, requests, step seconds, (holds the request's adapter, cached
        prompt tokens))``, should take the request (times in seconds).

        The predicted TPOT is the replica's step time once every request it runs or
        holds decodes, this one included; it fits when within the admission margin of
        the TPOT SLO that admission's prediction must meet there (``slo_margin`` times
        ``Prediction.tpot_slo_s``). A replica where it fits beats one where it does
        not: each stream sent to a replica slows every step there for as long as it
        decodes, which no TTFT prediction sees, so a replica that holds the prompt's
        prefix would otherwise take a whole burst on one prompt past the SLO while the
        other idles (docs/scheduling.md, "Routing"). Where it fits on neither, the lower
        predicted TPOT wins: the decode load is spread.

        Where it fits on both, the lower predicted TTFT wins. Each prediction counts
        only the prompt tokens that replica would compute, so it already credits a
        replica that holds the prompt's prefix with the prefill it saves; preferring that
        replica further (up to the TTFT SLO) loads it while the other idles and costs
        attainment. Within a step of each other, the replica holding the request's LoRA
        adapter, then the one holding more of the prompt, goes first (affinity breaks the
        tie), then the one with fewer requests.
        """
        (fits0, tpot0, t0, n0, step0, c0), (fits1, tpot1, t1, n1, step1, c1) = key0, key1
        if fits0 != fits1:
            return fits0
        if not fits0 and tpot0 != tpot1:
            return tpot0 < tpot1
        if abs(t0 - t1) <= max(step0, step1):
            # The same number of steps either way (short prompts all fit one step, so TTFT
            # does not see them queue): keep the prefix's replica, else balance the decode
            # load by request count, or every burst would go to the replica whose fitted
            # step time is lower.
            return c0 > c1 if c0 != c1 else n0 <= n1
        return t0 < t1


def _holds(snap: LoadSnapshot | None, adapter: str) -> bool:
    """The replica of ``snap`` holds LoRA adapter ``adapter`` in host memory."""
    return snap is not None and adapter in snap.loras
