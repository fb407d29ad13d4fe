"""The ingress's calls to a replica in its own process: no Ray, no messages.

``iterserve serve`` with one replica on one machine runs the engine in the server's
process (:mod:`deploy.local_server`), as ``vllm serve`` and ``iterserve batch run`` do:
on 2 cores the same replica inside Ray Serve streamed each token 23-32% slower than its
engine offline, and in process 7-9% (``bench/results/peers.md``, one run).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from policies import LoadSnapshot
from router.calls import ReplicaLost, accepted, record_item
from router.errors import ApiError
from router.prefix import PrefixMap, cached_tokens
from router.routing import RequestShape


class LocalCall:
    """One request's call (:mod:`router.calls`) over an in-process item stream
    (:func:`deploy.engine_replica.engine_items`).

    ``record`` (``deploy.metrics.RequestRecord``, or None) is told of every item and of
    how the call ended.
    """

    def __init__(self, items: Any, record: Any = None) -> None:
        self.gen = items
        self.record = record
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.replica = ""
        self.done = False

    async def start(self) -> None:
        """Queue the request on the engine.

        Raises:
            ApiError: the engine refused it (context or KV capacity, a bad parameter).
        """
        first = await self.gen.__anext__()
        self.done = "error" in first
        self.prompt_tokens, self.replica = accepted(first)

    async def items(self) -> AsyncIterator[dict]:
        """The request's step items.

        Raises:
            ReplicaLost: the engine failed or was shut down.
        """
        try:
            async for item in self.gen:
                self.cached_tokens = item.get("cached_tokens", self.cached_tokens)
                record_item(self.record, item)
                yield item
                if item["finished"]:
                    self.done = True
                    return
        except ApiError:
            raise
        except Exception as e:  # the engine died or shut down: that ends every stream
            self.done = True
            if self.record is not None:
                self.record.failed()
            raise ReplicaLost(f"the replica stopped: {e}") from e

    def cancel(self) -> None:
        """Abort the request (the engine frees its blocks before its next step)."""
        if self.done:
            return
        self.done = True
        if self.record is not None:
            self.record.aborted()
        # Closing the stream aborts its engine request (engine_items' contract). A stream
        # being iterated is closed by the cancellation of the task iterating it.
        if not self.gen.ag_running:
            asyncio.ensure_future(self.gen.aclose())


class LocalReplicas:
    """The one replica of this process, as the ingress sees its replicas.

    Args:
        replica: a :class:`deploy.engine_replica.EngineReplica`.
    """

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.prefixes = PrefixMap()
        """The prompt prefixes sent to the replica (admission's cached-token estimate, as
        the Ray router keeps it)."""

    @property
    def _alive(self) -> bool:
        return not self.replica.engine.dead

    async def info(self) -> dict[str, Any]:
        """The replica's tokenizer and limits.

        Raises:
            ApiError: 503 when its engine has failed.
        """
        if not self._alive:
            raise ApiError(503, "the engine failed; restart the server", code="not_ready")
        return self.replica.info()

    def call(self, args: tuple, shape: RequestShape, record: Any = None) -> LocalCall:
        """The call of request ``args`` (id, prompt token ids, sampling fields).

        Raises:
            ApiError: 503 when the engine has failed.
        """
        if not self._alive:
            raise ApiError(503, "the engine failed; restart the server", code="replica_unavailable")
        rid, ids, params = args
        self.prefixes.record(shape.prefix_hashes, self.replica.replica_id)
        return LocalCall(self.replica.items(rid, ids, params, shape, send_load=False), record)

    def loads(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """The replica's snapshot now and the tokens of ``shape``'s prompt it likely holds."""
        if not self._alive:
            return []
        snap = self.replica.engine.load_snapshot()
        matched = self.prefixes.matched_blocks(shape.prefix_hashes).get(self.replica.replica_id, 0)
        return [(snap, cached_tokens(matched, snap.block_size, shape.prompt_tokens))]

    def snapshots(self) -> dict[str, LoadSnapshot]:
        """The replica's snapshot by its id; empty once its engine failed."""
        return {self.replica.replica_id: self.replica.engine.load_snapshot()} if self._alive else {}

    def count(self) -> int:
        return int(self._alive)

    def stats(self) -> dict[str, dict]:
        """The replica's routing stats by its id (``/metrics`` renders them)."""
        return {self.replica.replica_id: self.replica.record_routing_stats()}
