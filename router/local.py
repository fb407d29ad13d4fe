"""The ingress's calls to a replica in its own process: no Ray, no messages.

``iterserve serve`` with one replica on one machine runs the engine in the server's
process (:mod:`deploy.local_server`), as ``vllm serve`` and ``iterserve batch run`` do:
the same replica inside Ray Serve costs more per streamed token than in process
(``bench/results/peers.md``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from policies import LoadSnapshot
from router.calls import ReplicaLost, accepted, record_item, request_failed
from router.contract import FirstItem, ModelInfo, Refused, RequestShape, StepItem
from router.errors import ApiError
from router.metrics import RequestRecord
from router.prefix import PrefixMap, cached_tokens


class LocalCall:
    """One request's call (a :class:`router.contract.ReplicaCall`) over an in-process item
    stream (:meth:`LocalReplica.items`).

    ``record`` (or None) is told of every item and of how the call ended.
    """

    def __init__(
        self,
        items: AsyncGenerator[FirstItem | StepItem, None],
        record: RequestRecord | None = None,
    ) -> None:
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
        self.done = isinstance(first, Refused)
        ok = accepted(first)
        self.prompt_tokens, self.replica = ok.prompt_tokens, ok.replica

    async def items(self) -> AsyncGenerator[StepItem, None]:
        """The request's step items.

        Raises:
            ReplicaLost: the engine failed or was shut down.
            ApiError: 503 ``request_failed``: this request failed inside the engine.
        """
        try:
            async for item in self.gen:
                if item.error is not None:
                    self.done = True
                    if self.record is not None:
                        self.record.failed()
                    raise request_failed(item)
                if item.cached_tokens is not None:
                    self.cached_tokens = item.cached_tokens
                record_item(self.record, item)
                yield item
                if item.finished:
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
        # Closing the stream aborts its engine request (LocalReplica.items' contract). A stream
        # being iterated is closed by the cancellation of the task iterating it.
        if not self.gen.ag_running:
            asyncio.ensure_future(self.gen.aclose())


class LocalEngine(Protocol):
    """What :class:`LocalReplicas` reads of its replica's engine (``engine.AsyncLLMEngine``)."""

    @property
    def dead(self) -> bool:
        """The engine's loop failed or was shut down."""
        ...

    def load_snapshot(self) -> LoadSnapshot: ...


class LocalReplica(Protocol):
    """A replica in the ingress's process (:class:`deploy.engine_replica.EngineReplica`)."""

    replica_id: str

    @property
    def engine(self) -> LocalEngine: ...

    def info(self) -> ModelInfo:
        """The tokenizer and the limits."""
        ...

    def items(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        shape: RequestShape,
        send_load: bool = True,
    ) -> AsyncGenerator[FirstItem | StepItem, None]:
        """One request's items: a :data:`router.contract.FirstItem`, then (once accepted)
        its step items. Closing the generator aborts the request."""
        ...

    def record_routing_stats(self) -> dict[str, Any]:
        """The load snapshot's fields and, under ``"metrics"``, the step counts."""
        ...

    async def load_lora(self, lora: LoRARequest) -> str | None:
        """Load adapter ``lora``; None, or why it cannot be served."""
        ...

    def unload_lora(self, name: str, pin: str | None = None) -> bool: ...


class LocalReplicas:
    """The one replica of this process (a :class:`router.contract.Replicas`).

    Args:
        replica: the replica, whose engine steps on its own thread.
    """

    def __init__(self, replica: LocalReplica) -> None:
        self.replica = replica
        self.prefixes = PrefixMap()
        """The prompt prefixes sent to the replica (admission's cached-token estimate, as
        the Ray router keeps it)."""

    @property
    def _alive(self) -> bool:
        return not self.replica.engine.dead

    async def info(self) -> ModelInfo:
        """The replica's tokenizer and limits.

        Raises:
            ApiError: 503 when its engine has failed.
        """
        if not self._alive:
            raise ApiError(503, "the engine failed; restart the server", code="not_ready")
        return self.replica.info()

    def call(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        shape: RequestShape,
        record: RequestRecord | None = None,
    ) -> LocalCall:
        """The call of one prompt (:meth:`router.contract.Replicas.call`).

        Raises:
            ApiError: 503 when the engine has failed.
        """
        if not self._alive:
            raise ApiError(503, "the engine failed; restart the server", code="replica_unavailable")
        self.prefixes.record(shape.prefix_hashes, self.replica.replica_id)
        items = self.replica.items(request_id, prompt_token_ids, params, shape, send_load=False)
        return LocalCall(items, record)

    async def load_lora(self, lora: LoRARequest) -> None:
        """Load adapter ``lora`` on the replica (:meth:`router.contract.Replicas.load_lora`).

        Raises:
            ApiError: 400 naming why the adapter cannot be served; 503 when the engine
                has failed.
        """
        if not self._alive:
            raise ApiError(503, "the engine failed; restart the server", code="not_ready")
        problem = await self.replica.load_lora(lora)
        if problem is not None:
            raise ApiError(400, problem, param="lora_path", code="invalid_value")

    async def unload_lora(self, name: str) -> None:
        """Have the replica forget adapter ``name``."""
        if self._alive:
            self.replica.unload_lora(name)

    def loads(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """The replica's snapshot now and the tokens of ``shape``'s prompt it likely holds."""
        if not self._alive:
            return []
        snap = self.replica.engine.load_snapshot()
        self.prefixes.fit(self.replica.replica_id, snap.num_kv_blocks)
        matched = self.prefixes.matched_blocks(shape.prefix_hashes).get(self.replica.replica_id, 0)
        return [(snap, cached_tokens(matched, snap.block_size, shape.prompt_tokens))]

    def snapshots(self) -> dict[str, LoadSnapshot]:
        """The replica's snapshot by its id; empty once its engine failed."""
        return {self.replica.replica_id: self.replica.engine.load_snapshot()} if self._alive else {}

    def count(self) -> int:
        return int(self._alive)

    def stats(self) -> dict[str, dict[str, Any]]:
        """The replica's routing stats by its id (``/metrics`` renders them)."""
        return {self.replica.replica_id: self.replica.record_routing_stats()}
