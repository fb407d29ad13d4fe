"""The Ray Serve ``RequestRouter`` class: power of two choices on predicted TPOT and TTFT.

See :mod:`router.routing` for the method. This module holds only the class, because Ray
Serve pickles a custom router's module by value into every handle's process: state that
the ingress must share with the router (the registry of routers, the request shape type)
lives in :mod:`router.routing`, which is imported normally.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from policies import AdmissionController, LoadSnapshot, make_classes, policy_from_spec
from router.choice import ReplicaChooser, RoutedSince
from router.contract import RequestShape
from router.prefix import cached_tokens
from router.routing import pinned_replica, register, shape_of

logger = logging.getLogger(__name__)

DEAD_FOR_S = 120.0
"""Seconds a replica found dead stays out of routing while Serve still lists it. Serve's
controller drops a dead replica within seconds; a replica whose engine only stalled
(``ModelReplica.check_health``) and recovered before Serve replaced it is routed to
again after this."""


class LoadAwareRouter(RequestRouter):
    """Two random replicas; first one that can decode the request within its TPOT SLO
    with all the requests it holds, then the one with the lower predicted TTFT.

    Prefix affinity: a replica that was sent a longer prefix of the prompt
    (:class:`router.prefix.PrefixMap`) replaces one of the two, and its prediction counts
    only the prompt tokens it would compute.

    When both have room for the TPOT SLO and their TTFT predictions are within one
    step's time of each other, the replica that holds more of the prompt goes first,
    else the one with fewer running and queued requests
    (:meth:`router.choice.ReplicaChooser.first_is_better`).

    Falls back to Ray Serve's queue-length choice between the two when either has not
    published a snapshot yet, or when the call carries no :class:`RequestShape`.

    ``request_router_kwargs`` (JSON): ``traffic_classes`` (every class's fields, as
    ``ServiceConfig.traffic_classes`` resolved them; None: the defaults) and ``policy``
    (the replicas' ``EngineConfig.policy_spec``; None: the priority policy).
    """

    def initialize_state(
        self,
        traffic_classes: Mapping[str, Mapping] | None = None,
        policy: Mapping | None = None,
        **_: object,
    ) -> None:
        self.admission = AdmissionController(
            make_classes(traffic_classes), policy=policy_from_spec(policy)
        )
        self.chooser = ReplicaChooser(self.admission)
        self.prefixes = self.chooser.prefixes
        """Which replicas were sent which prompt prefixes (:mod:`router.prefix`)."""
        self._routed = RoutedSince()
        self._streamed: dict[str, LoadSnapshot] = {}
        """The latest load each replica sent with a stream item, by its unique id."""
        self._lock = threading.RLock()  # the router runs on its own loop thread
        self._dead: dict[str, float] = {}
        """Unique ids of replicas a call found dead that Serve still lists (its
        controller learns of a death seconds later), with when (``time.monotonic``)."""
        register(self, self._deployment_id.app_name, self._deployment_id.name)

    # -- the load view (router.routing.LoadView) ------------------------------------------

    def observe_load(self, replica_unique_id: str, snap: LoadSnapshot) -> None:
        """A load the replica sent with a stream item (:class:`router.dispatch.RayCall`).

        Serve's own path is slow: its controller polls ``record_routing_stats`` in its
        control loop and broadcasts the result, so a published load is often half a
        second to a second old, while a TTFT SLO is a few seconds. A replica that streams
        sends its load once per change, about once per step."""
        with self._lock:
            self._streamed[replica_unique_id] = snap
            self.prefixes.fit(replica_unique_id, snap.num_kv_blocks)

    def snapshot(self, replica: RunningReplica) -> LoadSnapshot | None:
        """The replica's latest load (published through Serve, or sent with a stream
        item, whichever is newer) plus what was routed to it since."""
        snap = self._streamed.get(replica.replica_id.unique_id)
        stats = replica.routing_stats
        if stats and (snap is None or stats.get("timestamp", 0.0) > snap.timestamp):
            try:
                snap = LoadSnapshot.from_dict(stats)
            except (TypeError, ValueError, KeyError):
                logger.warning("replica %s published unreadable stats", replica.replica_id)
        if snap is None:
            return None
        with self._lock:
            self.prefixes.fit(replica.replica_id.unique_id, snap.num_kv_blocks)
            return self._routed.adjust(replica.replica_id, snap, time.time())

    def _live(self) -> list[tuple[ReplicaID, RunningReplica]]:
        """Serve's running replicas less those found dead."""
        dead = self._dead_ids()
        return [(rid, r) for rid, r in list(self._replicas.items()) if rid.unique_id not in dead]

    def _dead_ids(self) -> set[str]:
        """The replicas found dead within :data:`DEAD_FOR_S`."""
        if not self._dead:
            return set()
        now = time.monotonic()
        with self._lock:
            self._dead = {u: t for u, t in self._dead.items() if now - t < DEAD_FOR_S}
            return set(self._dead)

    def replica_died(self, replica_unique_id: str) -> None:
        """A call found the replica's actor dead (:meth:`router.routing.LoadView.replica_died`).

        Called from the ingress's event loop, not this router's thread: it only adds to
        a set that every read filters by (Serve's ``on_replica_actor_died`` would change the
        router's replica table from the wrong thread)."""
        with self._lock:
            self._dead[replica_unique_id] = time.monotonic()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica list; a replica found dead is forgotten once Serve drops it."""
        super().update_replicas(replicas)
        listed = {r.replica_id.unique_id for r in replicas}
        with self._lock:
            self._dead = {u: t for u, t in self._dead.items() if u in listed}

    def replica_stats(self) -> dict[str, dict]:
        """Every running replica's last published routing stats, by its unique id."""
        return {rid.unique_id: dict(r.routing_stats) for rid, r in self._live() if r.routing_stats}

    def snapshots(self) -> dict[ReplicaID, LoadSnapshot]:
        """Adjusted snapshots of every running replica that has published one."""
        out = {}
        for rid, replica in self._live():
            snap = self.snapshot(replica)
            if snap is not None:
                out[rid] = snap
        return out

    def unique_snapshots(self) -> dict[str, LoadSnapshot]:
        """:meth:`snapshots` by the replicas' unique ids (the ids the ingress knows)."""
        return {rid.unique_id: s for rid, s in self.snapshots().items()}

    def num_replicas(self) -> int:
        """Replicas running now (none found dead)."""
        return len(self._live())

    def replica_ids(self) -> set[str]:
        """The unique ids of the replicas running now (a replica being stopped or found
        dead is gone)."""
        return {rid.unique_id for rid, _ in self._live()}

    def loads_for(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """Each replica's adjusted snapshot with the tokens of ``shape``'s prompt it was
        sent before (so likely holds in its prefix cache), as ingress admission takes them."""
        with self._lock:
            matched = self.prefixes.matched_blocks(shape.prefix_hashes)
        return [
            (snap, cached_tokens(matched.get(rid, 0), snap.block_size, shape.prompt_tokens))
            for rid, snap in self.snapshots().items()
        ]

    # -- RequestRouter -------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        dead = self._dead_ids()
        if dead:
            candidate_replicas = [
                r for r in candidate_replicas if r.replica_id.unique_id not in dead
            ]
        if not candidate_replicas:
            return []
        pin = pinned_replica(pending_request)
        if pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        shape = shape_of(pending_request)
        if shape is None:
            return [self.chooser.rng.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        with self._lock:  # reentrant: snapshot() takes it again
            return self.chooser.choose(
                candidate_replicas, shape, self.snapshot, key=lambda r: r.replica_id
            )

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        shape = shape_of(pending_request)
        if shape is None:
            return
        with self._lock:
            matched = self.prefixes.matched_blocks(shape.prefix_hashes).get(replica_id, 0)
            self._routed.record(replica_id, time.time(), shape, matched)
            self.prefixes.record(shape.prefix_hashes, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self._routed.forget(replica_id)
            self.prefixes.forget(replica_id)
            self.prefixes.fit(replica_id.unique_id, 0)
            self._streamed.pop(replica_id.unique_id, None)
