"""One request's call to a model replica, re-sent elsewhere if its replica dies early.

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
from router.errors import ApiError
from router.routing import RequestShape, load_view
from router.step_streams import StepStreams, StreamLost

logger = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
"""Replicas tried for one request when they die before it produced a token."""

REPLICA_LOST = (RayActorError, ActorUnavailableError)


class ReplicaLost(Exception):
    """The replica serving a stream died after it had produced tokens."""


def accepted(first: dict) -> tuple[int, str]:
    """The prompt's length and the replica's id from a replica's first item.

    Raises:
        ApiError: the replica refused the request (its status, message and field).
    """
    if "error" in first:
        err = first["error"]
        raise ApiError(err["status"], err["message"], param=err.get("param"),
                       code=err.get("code"))
    return first["prompt_tokens"], first["replica"]


class Dispatch:
    """One request's call to a replica, re-sent elsewhere if its replica dies early.

    ``record`` (``deploy.metrics.RequestRecord``) is told of every item and of how the
    call ended. The call itself answers only the first item; the rest come on its
    replica's step stream (:mod:`router.step_streams`).
    """

    def __init__(self, handle: DeploymentHandle, args: tuple, shape: RequestShape,
                 streams: StepStreams, record: Any = None) -> None:
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
            self.gen = self.handle.generate.remote(*self.args, shape=self.shape,
                                                   ingress=self.streams.ingress_id)
            try:
                first = await self.gen.__anext__()
            except REPLICA_LOST as e:
                if self.attempts >= MAX_DISPATCH_ATTEMPTS:
                    raise ApiError(503, f"no replica could take the request: {e}",
                                   code="replica_unavailable") from e
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
        r = self.record
        if r is None:
            return
        if "queue_s" in item:
            r.scheduled(item["queue_s"])
        r.tokens(sum(len(o["token_ids"]) for o in item["outputs"]),
                 [o["finish_reason"] for o in item["outputs"] if o["finish_reason"]])
        if item["finished"]:
            r.finished()

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
