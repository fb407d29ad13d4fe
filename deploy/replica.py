"""The model-replica deployment: a thin Ray Serve wrapper around one AsyncLLMEngine.

The ingress tokenizes, validates the API fields and admits; the replica re-checks the
request against its engine (context and KV capacity), streams plain dicts back, and
publishes its load snapshot for routing and admission.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve

from deploy.metrics import StepMetrics
from engine import (
    AsyncLLMEngine,
    EngineConfig,
    RequestOutputKind,
    RequestRejectedError,
    SamplingParams,
)
from router.routing import RequestShape

logger = logging.getLogger(__name__)


class ModelReplica:
    """One engine replica.

    Args:
        engine_config: :class:`engine.EngineConfig` fields.
        num_threads: torch intra-op threads; the CPUs Ray reserved for this replica, so
            replicas sharing a machine do not oversubscribe it (on 2 cores, two replicas
            of 2 threads each run several times slower than two of 1).
    """

    def __init__(self, engine_config: dict[str, Any], num_threads: int = 1) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.engine = AsyncLLMEngine.from_config(EngineConfig(**engine_config))
        self.step_metrics = StepMetrics()
        self.engine.engine.on_step = self.step_metrics.record
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._outboxes = Outboxes()
        logger.info("replica ready (pid %d, %d torch threads)", os.getpid(), num_threads)

    def info(self) -> dict[str, Any]:
        """What the ingress needs once: the tokenizer (pickled by Ray) and the limits."""
        engine = self.engine.engine
        return {
            "tokenizer": engine.tokenizer,
            "limits": engine.limits,
        }

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: dict[str, Any], shape: RequestShape,
                       ingress: str) -> AsyncIterator[dict]:
        """Run one request: yield the first dict of :func:`engine_items` ("accepted" or a
        refusal) and put the later ones in ``ingress``'s :meth:`step_items` stream.

        The call stays open until the request ends, so cancelling it (client gone)
        aborts the engine request before its next step. If the engine fails, the stream
        gets ``{"lost": message}`` for the request.
        """
        try:
            async for item in engine_items(self.engine, self.replica_id, request_id,
                                           prompt_token_ids, params, shape):
                if "outputs" not in item:
                    yield item
                    continue
                self._outboxes.put(ingress, request_id, item)
                if item["finished"]:
                    return
        except Exception as e:  # the engine died: nobody reads this call after "accepted"
            self._outboxes.put(ingress, request_id, {"lost": f"{type(e).__name__}: {e}"})
            raise

    async def step_items(self, ingress: str, pin: str) -> AsyncIterator[list]:
        """Every item of ``ingress``'s requests on this replica, one list of
        ``(request id, item)`` per engine step (first an empty list: the stream is open).

        One message per step instead of one per request per step: at 8 streams on 2 cores
        that cut the ingress's CPU by 41-43% and the cost per token by 4-7%
        (``docs/served-overhead.md``). ``pin`` is this replica's id; the ingress's
        request router routes the call by it.
        """
        outbox = self._outboxes.open(ingress)
        try:
            yield []
            while True:
                yield await outbox.take()
        finally:
            self._outboxes.close(ingress, outbox)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this; the routers and the ingress's admission read it, and the
        ingress's ``/metrics`` renders its ``"metrics"``: :class:`deploy.metrics.StepMetrics`
        plus the prefix cache's lookups and hits since start, in tokens."""
        bm = self.engine.engine.block_manager
        metrics = {**self.step_metrics.to_dict(), "prefix_cache_queries": bm.num_queried_tokens,
                   "prefix_cache_hits": bm.num_hit_tokens}
        return {**self.engine.load_snapshot().to_dict(), "metrics": metrics}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if self.engine.dead:
            raise RuntimeError("engine loop failed")


async def engine_items(engine: AsyncLLMEngine, replica_id: str, request_id: str,
                       prompt_token_ids: list[int], params: dict[str, Any],
                       shape: RequestShape) -> AsyncIterator[dict]:
    """Run one request on ``engine``; yield dicts the ingress turns into OpenAI chunks.

    The first item is ``{"accepted": True, "prompt_tokens": n, "replica": id}`` once the
    request is queued, or ``{"error": {...}}`` (and nothing more) if the engine refuses it
    (context or KV capacity, a bad parameter), so a 400 can be answered before any stream
    starts. Then one item per step that produced tokens: ``{"outputs": [{"index", "text",
    "token_ids", "logprobs", "finish_reason", "stop_reason"}], "finished": bool}`` with this
    step's deltas; ``logprobs`` is a list (one per new token) of ``{token_id: logprob}`` or
    None. The first of these also has ``queue_s``: seconds from the engine's arrival to the
    first step that scheduled the request, and ``cached_tokens``: prompt tokens whose KV
    the prefix cache supplied.

    Any item may also carry ``load``: the engine's load snapshot (``LoadSnapshot.to_dict``)
    when it changed since the replica last sent one (``AsyncLLMEngine.load_update``), so
    the ingress's admission and routing see the replica's load step by step.

    Closing or cancelling the iteration aborts the engine request before its next step.
    """
    try:
        sampling = SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
        ids = engine.validate(prompt_token_ids, sampling, shape.traffic_class)
    except RequestRejectedError as e:
        yield {"error": {"message": str(e), "status": 400, "param": "prompt",
                         "code": "context_length_exceeded"}}
        return
    except ValueError as e:  # ParamError names the request field
        yield {"error": {"message": str(e), "status": 400,
                         "param": getattr(e, "param", None), "code": "invalid_value"}}
        return
    yield _with_load(engine, {"accepted": True, "prompt_tokens": len(ids), "replica": replica_id})
    first = True
    async for out in engine.generate(ids, sampling, request_id=request_id,
                                     priority=shape.priority,
                                     traffic_class=shape.traffic_class):
        items = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                  "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
                 for c in out.outputs if c.text or c.token_ids or c.finish_reason]
        item = {"outputs": items, "finished": out.finished}
        if first:
            first, m = False, out.metrics
            item["cached_tokens"] = out.num_cached_tokens
            if m.first_scheduled_time is not None:
                item["queue_s"] = m.first_scheduled_time - m.arrival_time
        if out.prompt_logprobs is not None:
            item["prompt_logprobs"] = out.prompt_logprobs
        yield _with_load(engine, item)


def _with_load(engine: AsyncLLMEngine, item: dict) -> dict:
    load = engine.load_update()
    if load is not None:
        item["load"] = load.to_dict()
    return item


class Outbox:
    """One ingress's items waiting for its :meth:`ModelReplica.step_items` stream."""

    def __init__(self) -> None:
        self._items: list[tuple[str, dict]] = []
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: dict) -> None:
        self._items.append((request_id, item))
        self._ready.set()

    async def take(self) -> list[tuple[str, dict]]:
        """Everything put since the last take; waits for at least one item. The engine
        hands a step's outputs to every request's stream in one event-loop pass, so one
        take gets the whole step."""
        await self._ready.wait()
        return self.drain()

    def drain(self) -> list[tuple[str, dict]]:
        """Everything put since the last take, without waiting."""
        self._ready.clear()
        items, self._items = self._items, []
        return items


class Outboxes:
    """The outbox of each ingress with requests on this replica.

    A stream opened again for the same ingress (its previous one failed while this
    replica lived) takes over the outbox's untaken items and every later one, so a
    stream that is still winding down can neither take them nor, when it ends, drop the
    outbox that the new stream reads. An ingress that is gone leaves behind at most its
    requests' last items.
    """

    def __init__(self) -> None:
        self._by_ingress: dict[str, Outbox] = {}

    def put(self, ingress: str, request_id: str, item: dict) -> None:
        self._by_ingress.setdefault(ingress, Outbox()).put(request_id, item)

    def open(self, ingress: str) -> Outbox:
        """A new outbox for ``ingress``'s new stream, holding what the old one held."""
        new, old = Outbox(), self._by_ingress.get(ingress)
        if old is not None:
            for request_id, item in old.drain():
                new.put(request_id, item)
        self._by_ingress[ingress] = new
        return new

    def close(self, ingress: str, outbox: Outbox) -> None:
        """The stream reading ``outbox`` ended; drop it unless a newer stream took over."""
        if self._by_ingress.get(ingress) is outbox:
            del self._by_ingress[ingress]
