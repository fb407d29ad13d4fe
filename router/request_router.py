"""The Ray Serve ``RequestRouter`` class: power of two choices on predicted TTFT.

See :mod:`router.routing` for the method. This module holds only the class, because Ray
Serve pickles a custom router's module by value into every handle's process: state that
the ingress must share with the router (the registry of routers, the request shape type)
lives in :mod:`router.routing`, which is imported normally.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Mapping

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from policies import AdmissionController, LoadSnapshot, classes_from_fields, policy_from_spec
from router.prefix import PrefixMap, cached_tokens
from router.routing import ROUTED_MEMORY_S, RequestShape, Routed, register, shape_of

logger = logging.getLogger(__name__)


class LoadAwareRouter(RequestRouter):
    """Two random replicas; the one with the lower predicted TTFT first.

    When the two predictions are within one step's time of each other, the replica with
    fewer running and queued requests goes first instead (see :meth:`choose_replicas`).

    Prefix affinity: a replica that was sent a longer prefix of the prompt
    (:class:`router.prefix.PrefixMap`) replaces one of the two, and its prediction counts
    only the prompt tokens it would compute; it goes first when it meets the class's TTFT
    SLO or predicts no worse than the other, so affinity never costs the SLO.

    Falls back to Ray Serve's queue-length choice between the two when either has not
    published a snapshot yet, or when the call carries no :class:`RequestShape`.

    ``request_router_kwargs`` (JSON): ``traffic_classes`` (every class's fields, as
    ``ServiceConfig.traffic_classes`` resolved them; None: the defaults) and ``policy``
    (the replicas' ``EngineConfig.policy_spec``; None: the priority policy).
    """

    def initialize_state(self, traffic_classes: Mapping[str, Mapping] | None = None,
                         policy: Mapping | None = None, **_: object) -> None:
        self.admission = AdmissionController(classes_from_fields(traffic_classes),
                                             policy=policy_from_spec(policy))
        self._routed: dict[ReplicaID, deque[Routed]] = {}
        self.prefixes = PrefixMap()
        """Which replicas were sent which prompt prefixes (:mod:`router.prefix`)."""
        self._lock = threading.Lock()  # the router runs on its own loop thread
        register(self)

    # -- the load view -------------------------------------------------------------------

    def snapshot(self, replica: RunningReplica) -> LoadSnapshot | None:
        """The replica's last published load plus what was routed to it since."""
        stats = replica.routing_stats
        if not stats:
            return None
        try:
            snap = LoadSnapshot.from_dict(stats)
        except (TypeError, ValueError, KeyError):
            logger.warning("replica %s published unreadable stats", replica.replica_id)
            return None
        with self._lock:
            routed = self._routed.get(replica.replica_id, ())
            while routed and routed[0].time_s < min(snap.timestamp,
                                                    time.time() - ROUTED_MEMORY_S):
                routed.popleft()
            since = [r.shape for r in routed if r.time_s >= snap.timestamp]
        return snap.with_queued((s.traffic_class, s.prompt_tokens) for s in since)

    def replica_stats(self) -> dict[str, dict]:
        """Every running replica's last published routing stats, by its unique id."""
        return {rid.unique_id: dict(r.routing_stats)
                for rid, r in list(self._replicas.items()) if r.routing_stats}

    def snapshots(self) -> dict[ReplicaID, LoadSnapshot]:
        """Adjusted snapshots of every running replica that has published one."""
        out = {}
        for rid, replica in list(self._replicas.items()):
            snap = self.snapshot(replica)
            if snap is not None:
                out[rid] = snap
        return out

    def loads_for(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """Each replica's adjusted snapshot with the tokens of ``shape``'s prompt it was
        sent before (so likely holds in its prefix cache), as ingress admission takes them."""
        with self._lock:
            matched = self.prefixes.matched_blocks(shape.prefix_hashes)
        return [(snap, cached_tokens(matched.get(rid, 0), snap.block_size, shape.prompt_tokens))
                for rid, snap in self.snapshots().items()]

    # -- RequestRouter -------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        shape = shape_of(pending_request)
        if shape is None:
            return [pair]
        with self._lock:
            matched = self.prefixes.matched_blocks(shape.prefix_hashes)
        # A replica that was sent a longer prefix of this prompt competes with the pair.
        affine = max(candidate_replicas, key=lambda r: matched.get(r.replica_id, 0))
        if matched.get(affine.replica_id, 0) > max(matched.get(r.replica_id, 0) for r in pair):
            pair = [affine, *(r for r in pair if r is not affine)][:2]
        if len(pair) == 1:
            return [pair]
        keys = []
        for r in pair:
            snap = self.snapshot(r)
            if snap is None:
                return [pair]  # no stats yet: Ray Serve's queue-length choice
            cached = cached_tokens(matched.get(r.replica_id, 0), snap.block_size,
                                   shape.prompt_tokens)
            pred = self.admission.predict(snap, shape.traffic_class,
                                          shape.prompt_tokens - cached, shape.priority)
            load = snap.total_running + sum(snap.waiting_requests.values())
            keys.append((pred.ttft_s, load, snap.step_time(0, snap.total_running + 1), cached))
        first, second = pair if self._first_is_better(shape, *keys) else pair[::-1]
        # The other replica stays as a second rank, used if the first refuses (full queue).
        return [[first], [second]]

    def _first_is_better(self, shape: RequestShape, key0: tuple, key1: tuple) -> bool:
        """Whether the first of two replicas, keyed ``(predicted TTFT, requests, step
        seconds, cached prompt tokens)``, should take the request."""
        (t0, n0, step0, c0), (t1, n1, step1, c1) = key0, key1
        if c0 != c1:
            # Prefix affinity breaks ties within the SLO: the replica that holds more of
            # the prompt, unless only the other meets the class's TTFT SLO.
            slo = self.admission.classes[shape.traffic_class].ttft_slo_s
            more, other = (t0, t1) if c0 > c1 else (t1, t0)
            return (c0 > c1) == (more <= slo or more <= other)
        if abs(t0 - t1) <= max(step0, step1):
            # The same number of steps either way (short prompts all fit one step, so TTFT
            # does not see them queue): balance the decode load by request count instead,
            # or every burst would go to the replica whose fitted step time is lower.
            return n0 <= n1
        return t0 < t1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        shape = shape_of(pending_request)
        if shape is None:
            return
        with self._lock:
            self._routed.setdefault(replica_id, deque()).append(Routed(time.time(), shape))
            self.prefixes.record(shape.prefix_hashes, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self._routed.pop(replica_id, None)
            self.prefixes.forget(replica_id)
