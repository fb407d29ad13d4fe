"""The model-replica deployment: a thin Ray Serve wrapper around one :class:`EngineReplica`.

The ingress tokenizes, validates the API fields, builds the request's
:class:`engine.core.params.SamplingParams` and admits; the replica's engine checks what
only it can (vocabulary, context and KV capacity), streams the items of
:mod:`router.contract` back, and publishes its load snapshot for routing and admission.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from deploy.engine_replica import EngineReplica
from engine.core.params import PoolingParams, SamplingParams
from engine.core.step_cost import LinearCost
from policies.scaling_signals import encode_replica, replica_load
from router.contract import FirstItem, Lost, RequestShape, StepItem, StreamItem

logger = logging.getLogger(__name__)


class ModelReplica(EngineReplica):
    """One engine replica as a Ray Serve deployment (the arguments of :class:`EngineReplica`
    but its id, which is Serve's unique id of the replica).

    Args:
        stall_timeout_s: seconds the engine may hold unfinished requests without
            finishing a step before :meth:`check_health` fails
            (``ServiceConfig.replica_stall_timeout_s``).
    """

    def __init__(
        self,
        engine_config: dict[str, Any],
        num_threads: int = 1,
        twin_cost: LinearCost | None = None,
        stall_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(
            engine_config,
            num_threads,
            serve.get_replica_context().replica_id.unique_id,
            twin_cost=twin_cost,
        )
        self.stall_timeout_s = stall_timeout_s
        self._outboxes = Outboxes()
        self._serving: dict[str, str] = {}
        """The ingress of each request running here, by request id."""
        self._scaling_signals: dict[str, float] = {}

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        shape: RequestShape,
        ingress: str,
        resume: tuple[int, ...] = (),
    ) -> AsyncIterator[FirstItem]:
        """Run one request: yield the first item of :func:`deploy.engine_replica.engine_items`
        (:data:`router.contract.FirstItem`) and put the later ones in ``ingress``'s
        :meth:`step_items` stream. ``resume``: the output tokens it produced on a replica
        that died (:mod:`router.dispatch`).

        The call stays open until the request ends, so cancelling it (client gone)
        aborts the engine request before its next step. If the engine fails, the stream
        gets a :class:`router.contract.Lost` for the request.
        """
        self._serving[request_id] = ingress
        try:
            async for item in self.items(
                request_id, prompt_token_ids, params, shape, resume=resume
            ):
                if not isinstance(item, StepItem):
                    yield item
                    continue
                self._outboxes.put(ingress, request_id, item)
                if item.finished:
                    return
        except Exception as e:  # the engine died: nobody reads this call after Accepted
            self._outboxes.put(ingress, request_id, Lost(f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._serving.pop(request_id, None)

    async def step_items(
        self, ingress: str, pin: str
    ) -> AsyncIterator[list[tuple[str, StreamItem]]]:
        """Every item of ``ingress``'s requests on this replica, one list of
        ``(request id, item)`` per engine step (first an empty list: the stream is open).

        One message per step instead of one per request per step, which cuts the
        ingress's CPU and the cost per token. ``pin`` is
        this replica's id; the ingress's request router routes the call by it.
        """
        outbox = self._outboxes.open(ingress)
        try:
            yield []
            while True:
                yield await outbox.take()
        finally:
            self._outboxes.close(ingress, outbox)

    def autoscale_signals(self, signals: dict[str, float], pin: str) -> None:
        """Keep the ingress's latest per-class counts for :meth:`record_autoscaling_stats`
        (:mod:`policies.scaling_signals`). ``pin`` is this replica's id (the ingress sends
        them to every replica)."""
        self._scaling_signals = dict(signals)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load and the ingress's last per-class counts, flat
        (:mod:`policies.scaling_signals`). Ray Serve calls it on deployments with an
        ``autoscaling_config`` and hands the numbers to the autoscaling policy in its
        controller (:class:`deploy.autoscale.ServePolicy`)."""
        own = encode_replica(replica_load(self.engine.load_snapshot()))
        return {**own, **self._scaling_signals}

    def check_health(self) -> None:
        """Ray Serve calls this every ``health_check_period_s``; raising (three times in a
        row) makes it replace the replica.

        Fails when the engine loop died, or when it holds unfinished requests and has
        finished no step for ``stall_timeout_s`` (a replica that answers pings but no
        longer steps). A stalled replica's requests get a :class:`router.contract.Lost`
        at once, so that their ingress moves them to another replica without waiting
        for Serve to replace this one.
        """
        if self.engine.dead:
            raise RuntimeError("engine loop failed")
        stalled = self.progress.stalled_s()
        if stalled > self.stall_timeout_s:
            message = (
                f"engine stalled: no step finished for {stalled:.1f} s with "
                f"{self.engine.num_unfinished} requests unfinished"
            )
            for request_id, ingress in list(self._serving.items()):
                self._outboxes.put(ingress, request_id, Lost(message))
            self._serving.clear()
            logger.error(message)
            raise RuntimeError(message)


class Outbox:
    """One ingress's items waiting for its :meth:`ModelReplica.step_items` stream."""

    def __init__(self) -> None:
        self._items: list[tuple[str, StreamItem]] = []
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: StreamItem) -> None:
        self._items.append((request_id, item))
        self._ready.set()

    async def take(self) -> list[tuple[str, StreamItem]]:
        """Everything put since the last take; waits for at least one item. The engine
        hands a step's outputs to every request's stream in one event-loop pass, so one
        take gets the whole step."""
        await self._ready.wait()
        return self.drain()

    def drain(self) -> list[tuple[str, StreamItem]]:
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

    def put(self, ingress: str, request_id: str, item: StreamItem) -> None:
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
