"""One stream per replica carrying every step's items for this ingress's requests.

Each request's call to a replica (:class:`router.dispatch.RayCall`) returns only its
first item (:data:`router.contract.FirstItem`) and stays open until the request ends, so
that cancelling it still aborts the request. The tokens of all of this ingress's requests
on a replica come back on one ``step_items`` stream from that replica: one message per
engine step instead of one per request per step, which cuts the ingress's CPU and the
cost per token.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from ray.exceptions import ActorDiedError
from ray.serve.handle import DeploymentHandle

from router.contract import StreamItem

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 30.0
"""Seconds to wait for a replica's stream to open (the replica may have died meanwhile)."""


class StreamLost(Exception):
    """The stream of the replica serving a request ended or failed.

    Args:
        message: why.
        replica: the replica whose stream it was.
        final: see :attr:`final`.
    """

    def __init__(self, message: str, replica: str = "", final: bool = False) -> None:
        super().__init__(message)
        self.replica = replica
        self.final = final
        """The server is stopping: the request ends here rather than moving elsewhere."""


class StepStreams:
    """This ingress's per-replica streams, and a queue per request for its items.

    A queue receives the request's items (:data:`router.contract.StreamItem`) in order,
    or a :class:`StreamLost` when its replica's stream fails. ``on_dead`` is told a
    replica's id when its stream failed because the replica's actor died, before its
    requests hear of it (so that a request migrating from it is not routed back to it).
    """

    def __init__(
        self, handle: DeploymentHandle, on_dead: Callable[[str], None] | None = None
    ) -> None:
        self.ingress_id = uuid.uuid4().hex
        self._handle = handle
        self._on_dead = on_dead
        self._queues: dict[str, asyncio.Queue[StreamItem | StreamLost]] = {}
        self._replica_of: dict[str, str] = {}
        self._left: dict[str, set[str]] = {}
        """The replicas each migrated request left; their late items are dropped."""
        self._streams: dict[str, asyncio.Task] = {}

    def register(self, request_id: str) -> asyncio.Queue[StreamItem | StreamLost]:
        """The request's queue (a new one, or the one it has: a re-sent request keeps it)."""
        return self._queues.setdefault(request_id, asyncio.Queue())

    def assign(self, request_id: str, replica: str) -> None:
        """The replica accepted the request: open that replica's stream if none is open."""
        self._replica_of[request_id] = replica
        task = self._streams.get(replica)
        if task is None or task.done():
            self._streams[replica] = asyncio.get_running_loop().create_task(self._consume(replica))

    def forget(self, request_id: str) -> None:
        """Drop the request's queue; its later items, if any, are discarded."""
        self._queues.pop(request_id, None)
        self._replica_of.pop(request_id, None)
        self._left.pop(request_id, None)

    def leave(self, request_id: str, replica: str) -> None:
        """The request moves off ``replica``: an item that replica still sends for it
        (a stalled engine that resumed) is dropped, so no token comes twice."""
        self._left.setdefault(request_id, set()).add(replica)
        if self._replica_of.get(request_id) == replica:
            del self._replica_of[request_id]

    def close_unused(self, running: set[str]) -> list[str]:
        """Close the stream of each replica not in ``running`` (Serve stopped routing to
        it: it is being scaled down or replaced) that none of this ingress's requests is
        on any more; the replicas whose streams were closed.

        An open stream counts as a request in flight on the replica, so Serve's graceful
        shutdown of the replica would wait for it until its timeout ran out."""
        busy = set(self._replica_of.values())
        closed = []
        for replica, task in list(self._streams.items()):
            if replica not in running and replica not in busy and not task.done():
                task.cancel()
                closed.append(replica)
        return closed

    @property
    def open_requests(self) -> int:
        """Requests with a queue here (sent and not yet ended or forgotten)."""
        return len(self._queues)

    def end_all(self, message: str) -> None:
        """End every open request with a final :class:`StreamLost` (the server stops)."""
        for queue in self._queues.values():
            queue.put_nowait(StreamLost(message, final=True))

    def close_all(self) -> None:
        """Close every stream (the ingress is stopping)."""
        for task in list(self._streams.values()):
            task.cancel()

    def deliver(self, batch: list[tuple[str, StreamItem]], replica: str = "") -> None:
        """Route one step's items from ``replica`` to their requests' queues."""
        for request_id, item in batch:
            queue = self._queues.get(request_id)
            if queue is not None and replica not in self._left.get(request_id, ()):
                queue.put_nowait(item)

    def fail(self, replica: str, error: BaseException) -> None:
        """Tell every request on ``replica`` that its stream is gone."""
        for request_id, r in list(self._replica_of.items()):
            if r == replica and request_id in self._queues:
                self._queues[request_id].put_nowait(StreamLost(str(error), replica))

    async def _consume(self, replica: str) -> None:
        gen = self._handle.step_items.remote(self.ingress_id, pin=replica)
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_S):  # not wait_for: it can swallow a cancel
                await gen.__anext__()
            async for batch in gen:
                self.deliver(batch, replica)
            raise StreamLost("the replica ended its step stream")
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # the replica died or its stream could not open
            gen.cancel()
            logger.warning("step stream of replica %s ended: %s", replica, e)
            if isinstance(e, ActorDiedError) and self._on_dead is not None:
                self._on_dead(replica)
            self.fail(replica, e)
        finally:
            if self._streams.get(replica) is asyncio.current_task():
                del self._streams[replica]
