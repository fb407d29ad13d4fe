"""One request's call to a Ray Serve model replica, re-sent elsewhere if its replica dies
early; :class:`RayReplicas`, the deployment as the ingress sees its replicas.

The replica's call answers :class:`router.contract.Accepted` (or a
:class:`router.contract.Refused`, which becomes a 400 before any stream starts); then one
:class:`router.contract.StepItem` per step that produced tokens comes on the replica's
step stream (:mod:`router.step_streams`). If the replica dies (or its engine fails) before the
request produced a token the request is sent again, to the replica the router picks;
once tokens were streamed, :class:`ReplicaLost` ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from policies import LoadSnapshot
from router.calls import ReplicaLost, accepted, record_item, request_failed
from router.contract import Lost, ModelInfo, Refused, RequestShape, StepItem
from router.errors import ApiError
from router.metrics import RequestRecord
from router.routing import LoadView, load_view
from router.step_streams import StepStreams, StreamLost

logger = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
"""Replicas tried for one request when they die before it produced a token."""

REPLICA_LOST = (RayActorError, ActorUnavailableError)


class Dispatch:
    """One request's call to a replica (a :class:`router.contract.ReplicaCall`), re-sent
    elsewhere if its replica dies early.

    ``record`` is told of every item and of how the call ended. The call itself answers
    only the first item; the rest come on its replica's step stream
    (:mod:`router.step_streams`).
    """

    def __init__(
        self,
        handle: DeploymentHandle,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        shape: RequestShape,
        streams: StepStreams,
        record: RequestRecord | None = None,
    ) -> None:
        self.handle = handle
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.shape = shape
        self.record = record
        self.streams = streams
        self.gen: DeploymentResponseGenerator | None = None
        self.produced = False
        self.done = False
        self.prompt_tokens = 0
        self.cached_tokens = 0
        """Prompt tokens the replica's prefix cache supplied (known from the first step)."""
        self.replica = ""
        """The serving replica's id (Ray Serve's unique id), once accepted."""
        self.attempts = 0

    async def start(self) -> None:
        """Send the request; return once a replica accepted it.

        Raises:
            ApiError: 400 if the replica refuses it (context or KV capacity), 503 if no
                replica could take it.
        """
        while True:
            self.attempts += 1
            self.streams.register(self.request_id)
            self.gen = self.handle.generate.remote(
                self.request_id,
                self.prompt_token_ids,
                self.params,
                shape=self.shape,
                ingress=self.streams.ingress_id,
            )
            try:
                first = await self.gen.__anext__()
            except REPLICA_LOST as e:
                if self.attempts >= MAX_DISPATCH_ATTEMPTS:
                    raise ApiError(
                        503, f"no replica could take the request: {e}", code="replica_unavailable"
                    ) from e
                logger.warning("replica lost before accepting a request; re-sending: %s", e)
                continue
            if isinstance(first, Refused):
                self.done = True
            ok = accepted(first)
            self.prompt_tokens, self.replica = ok.prompt_tokens, ok.replica
            self._load(ok.load)
            self.streams.assign(self.request_id, self.replica)
            return

    async def items(self) -> AsyncIterator[StepItem]:
        """The replica's step items; re-sends the request if its replica dies first.

        Raises:
            ReplicaLost: the replica died after the request had produced tokens.
            ApiError: a re-sent request was refused (see :meth:`start`).
        """
        queue = self.streams.register(self.request_id)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, StreamLost | Lost):
                    why = item.message if isinstance(item, Lost) else str(item)
                    self.gen.cancel()  # in case only the stream failed, not the replica
                    if self.produced or self.attempts >= MAX_DISPATCH_ATTEMPTS:
                        self._failed()
                        raise ReplicaLost(f"the replica serving this request failed: {why}")
                    logger.warning("replica lost before the first token; re-sending: %s", why)
                    await self.start()
                    continue
                if item.error is not None:  # the request alone failed; its engine goes on
                    self.done = True
                    self._failed()
                    raise request_failed(item)
                if item.outputs:
                    self.produced = True
                self._observe(item)
                yield item
                if item.finished:
                    self.done = True
                    return
        finally:
            self.streams.forget(self.request_id)

    def _load(self, load: LoadSnapshot | None) -> None:
        """Hand a load the replica sent with an item to this process's router."""
        if load is None:
            return
        view = load_view(self.handle.app_name, self.handle.deployment_name)
        if view is not None:
            view.observe_load(self.replica, load)

    def _observe(self, item: StepItem) -> None:
        self._load(item.load)
        if item.cached_tokens is not None:
            self.cached_tokens = item.cached_tokens
        record_item(self.record, item)

    def _failed(self) -> None:
        if self.record is not None:
            self.record.failed()

    def cancel(self) -> None:
        """Abort the replica call (the engine frees the request's blocks next step)."""
        self.streams.forget(self.request_id)
        if self.gen is not None and not self.done:
            self.gen.cancel()
            self.done = True
            if self.record is not None:
                self.record.aborted()


class RayReplicas:
    """The model deployment's replicas through Ray Serve (:class:`router.contract.Replica`).

    Args:
        handle: the model deployment's handle.
    """

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle.options(stream=True)
        self.streams = StepStreams(self.handle)
        self._info_handle = handle

    async def info(self) -> ModelInfo:
        """One replica's tokenizer and limits.

        Raises:
            ApiError: 503 when no replica answers.
        """
        try:
            return await self._info_handle.info.remote()
        except REPLICA_LOST as e:
            raise ApiError(503, f"no model replica is ready: {e}", code="not_ready") from e

    def call(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        shape: RequestShape,
        record: RequestRecord | None = None,
    ) -> Dispatch:
        """The call of one prompt (:meth:`router.contract.Replica.call`)."""
        return Dispatch(
            self.handle, request_id, prompt_token_ids, params, shape, self.streams, record
        )

    def _view(self) -> LoadView | None:
        return load_view(self.handle.app_name, self.handle.deployment_name)

    def loads(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """Each replica's snapshot and the tokens of ``shape``'s prompt it likely holds."""
        view = self._view()
        return view.loads_for(shape) if view is not None else []

    def snapshots(self) -> dict[str, LoadSnapshot]:
        """Each replica's adjusted snapshot by its unique id."""
        view = self._view()
        return view.unique_snapshots() if view is not None else {}

    def count(self) -> int:
        """Running replicas."""
        view = self._view()
        return view.num_replicas() if view is not None else 0

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's last published routing stats by its unique id."""
        view = self._view()
        return view.replica_stats() if view is not None else {}

    def close_retired_streams(self) -> list[str]:
        """Close the step streams of replicas Serve no longer routes to once no request
        is on them (:meth:`router.step_streams.StepStreams.close_unused`), so that a
        replica being scaled down stops as soon as its last request ends."""
        view = self._view()
        return [] if view is None else self.streams.close_unused(view.replica_ids())

    async def send_scaling_signals(self, signals: dict[str, float], timeout_s: float) -> int:
        """Give ``signals`` (:meth:`router.scaling.ScalingSignals.encode`) to every running
        replica that has published its load (``ModelReplica.autoscale_signals``, pinned to
        each); the replicas that took them within ``timeout_s``. A replica that fails or
        is slow gets the next ones."""
        view = self._view()
        if view is None:  # no call has gone through the handle yet: nothing to scale on
            return 0
        calls = [
            self._info_handle.autoscale_signals.remote(signals, pin=rid)
            for rid in view.replica_stats()
        ]
        if not calls:
            return 0
        tasks = {asyncio.ensure_future(_awaited(c)): c for c in calls}
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            tasks[task].cancel()
            task.cancel()
        failed = [t.exception() for t in done if t.exception() is not None]
        if failed:
            logger.warning(
                "scaling signals not delivered to %d replicas: %s", len(failed), failed[0]
            )
        return len(done) - len(failed)


async def _awaited(response: Any) -> Any:
    return await response
