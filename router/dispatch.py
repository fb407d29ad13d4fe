"""One request's call to a Ray Serve model replica, re-sent elsewhere if its replica dies
early; :class:`RayReplicas`, the deployment as the ingress sees its replicas.

The replica's call answers "accepted" (or a length error, which becomes a 400 before any
stream starts); then one item per step that produced tokens comes on the replica's step
stream (:mod:`router.step_streams`). If the replica dies (or its engine fails) before the
request produced a token the request is sent again, to the replica the router picks;
once tokens were streamed, :class:`ReplicaLost` ends the stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from policies import LoadSnapshot
from router.calls import ReplicaLost, accepted, record_item
from router.errors import ApiError
from router.routing import RequestShape, load_view
from router.step_streams import StepStreams, StreamLost

logger = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
"""Replicas tried for one request when they die before it produced a token."""

REPLICA_LOST = (RayActorError, ActorUnavailableError)


class Dispatch:
    """One request's call to a replica, re-sent elsewhere if its replica dies early.

    ``record`` (``deploy.metrics.RequestRecord``) is told of every item and of how the
    call ended. The call itself answers only the first item; the rest come on its
    replica's step stream (:mod:`router.step_streams`).
    """

    def __init__(
        self,
        handle: DeploymentHandle,
        args: tuple,
        shape: RequestShape,
        streams: StepStreams,
        record: Any = None,
    ) -> None:
        self.handle = handle
        self.args = args
        self.shape = shape
        self.record = record
        self.streams = streams
        self.request_id: str = args[0]
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
                *self.args, shape=self.shape, ingress=self.streams.ingress_id
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
            if "error" in first:
                self.done = True
            self.prompt_tokens, self.replica = accepted(first)
            self._load(first)
            self.streams.assign(self.request_id, self.replica)
            return

    async def items(self) -> AsyncIterator[dict]:
        """The replica's step items; re-sends the request if its replica dies first.

        Raises:
            ReplicaLost: the replica died after the request had produced tokens.
            ApiError: a re-sent request was refused (see :meth:`start`).
        """
        queue = self.streams.register(self.request_id)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, StreamLost) or "lost" in item:
                    self.gen.cancel()  # in case only the stream failed, not the replica
                    if self.produced or self.attempts >= MAX_DISPATCH_ATTEMPTS:
                        self._failed()
                        raise ReplicaLost(f"the replica serving this request failed: {item}")
                    logger.warning("replica lost before the first token; re-sending: %s", item)
                    await self.start()
                    continue
                if item["outputs"]:
                    self.produced = True
                self._observe(item)
                yield item
                if item["finished"]:
                    self.done = True
                    return
        finally:
            self.streams.forget(self.request_id)

    def _load(self, item: dict) -> None:
        """Hand a load the replica sent with ``item`` to this process's router."""
        if "load" not in item:
            return
        view = load_view(self.handle.app_name, self.handle.deployment_name)
        if view is not None:
            view.observe_load(self.replica, LoadSnapshot.from_dict(item["load"]))

    def _observe(self, item: dict) -> None:
        self._load(item)
        self.cached_tokens = item.get("cached_tokens", self.cached_tokens)
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
    """The model deployment's replicas through Ray Serve, as the ingress sees its replicas.

    Args:
        handle: the model deployment's handle.
    """

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle.options(stream=True)
        self.streams = StepStreams(self.handle)
        self._info_handle = handle

    async def info(self) -> dict[str, Any]:
        """One replica's tokenizer and limits.

        Raises:
            ApiError: 503 when no replica answers.
        """
        try:
            return await self._info_handle.info.remote()
        except REPLICA_LOST as e:
            raise ApiError(503, f"no model replica is ready: {e}", code="not_ready") from e

    def call(self, args: tuple, shape: RequestShape, record: Any = None) -> Dispatch:
        """The call of request ``args`` (id, prompt token ids, sampling fields)."""
        return Dispatch(self.handle, args, shape, self.streams, record)

    def _view(self) -> Any:
        return load_view(self.handle.app_name, self.handle.deployment_name)

    def loads(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        """Each replica's snapshot and the tokens of ``shape``'s prompt it likely holds."""
        view = self._view()
        return view.loads_for(shape) if view is not None else []

    def snapshots(self) -> dict[str, LoadSnapshot]:
        """Each replica's adjusted snapshot by its unique id."""
        view = self._view()
        snaps = view.snapshots() if view is not None else {}
        return {rid.unique_id: s for rid, s in snaps.items()}

    def count(self) -> int:
        """Running replicas."""
        view = self._view()
        return len(view.curr_replicas) if view is not None else 0

    def stats(self) -> dict[str, dict]:
        """Each replica's last published routing stats by its unique id."""
        view = self._view()
        return view.replica_stats() if view is not None else {}
