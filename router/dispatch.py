"""One request's call to a Ray Serve model replica, migrated to another if its replica
dies; :class:`RayReplicas`, the deployment as the ingress sees its replicas.

The replica's call answers :class:`router.contract.Accepted` (or a
:class:`router.contract.Refused`, which becomes a 400 before any stream starts); then one
:class:`router.contract.StepItem` per step that produced tokens comes on the replica's
step stream (:mod:`router.step_streams`).

Migration: if the replica dies (or its engine fails), the request is sent again, to the
replica the router picks, with the output tokens it already streamed
(``resume=``, :meth:`engine.LLMEngine.add_request`'s ``resume_token_ids``): the new
replica prefills the prompt and those tokens (its prefix cache holds the prompt if it
served it before), counts them as output (``max_tokens``, ``min_tokens``, penalties, a
``json_schema``'s grammar), and its detokenizer has read them, so its first text delta
continues the text already sent: no token or character is repeated or dropped, and a
stop string spanning the boundary is still found. The new replica's items continue the
same :meth:`RayCall.items` iterator; ``prompt_tokens`` and ``cached_tokens`` stay the
first replica's. A greedy request's output is the one an uninterrupted run gives. A
seeded request continues with :func:`migrated_seed` (deterministic, but not the draws
the first replica would have made). The prompt's log-probabilities came with the first
item and are not asked for again.

Not migrated (their stream ends with :class:`ReplicaLost`, an error event): requests with
``n > 1``, and any request once :data:`MAX_DISPATCH_ATTEMPTS` replicas failed it. A
request whose replica dies before its first token is sent again the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from policies import LoadSnapshot
from router.calls import RETRY_AFTER_S, ReplicaLost, accepted, record_item, request_failed
from router.contract import Lost, ModelInfo, Refused, RequestShape, StepItem
from router.errors import ApiError
from router.metrics import RequestRecord
from router.routing import LoadView, load_view
from router.step_streams import StepStreams, StreamLost

logger = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
"""Replicas tried for one request (the first and those it migrates to) when they die."""

REPLICA_LOST = (RayActorError, ActorUnavailableError)

UNLOAD_TIMEOUT_S = 10.0
"""Seconds the ingress waits for the replicas to forget an unloaded adapter."""
MIGRATE_TIMEOUT_S = 30.0
"""Seconds a migrating request waits for another replica to accept it (every live one
may be at ``max_ongoing_requests``) before its stream ends with an error event."""

_WEYL = 0x9E3779B97F4A7C15
"""2**64 over the golden ratio, odd: SplitMix64's increment (Steele, Lea and Flood,
"Fast Splittable Pseudorandom Number Generators", OOPSLA 2014)."""


def migrated_seed(seed: int, produced: int) -> int:
    """The seed a seeded request continues with on a new replica after ``produced``
    output tokens: ``seed + produced * 0x9E3779B97F4A7C15`` wrapped to a signed 64-bit
    integer (``SamplingParams.seed``'s range). The same request migrated at the same
    token continues the same way; each migration point gets a different seed, so the
    continuation does not replay the draws of the request's first tokens."""
    x = (seed + produced * _WEYL) % 2**64
    return x - 2**64 if x >= 2**63 else x


class RayCall:
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
        params: SamplingParams | PoolingParams,
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
        self.output_ids: list[int] = []
        """The output token ids streamed so far (the request's only sequence)."""
        self.migrations = 0
        """Times the request moved to another replica after it had produced tokens."""

    async def start(self) -> None:
        """Send the request; return once a replica accepted it.

        Raises:
            ApiError: 400 if the replica refuses it (context or KV capacity), 503 if no
                replica could take it.
        """
        while True:
            self.attempts += 1
            self.streams.register(self.request_id)
            params, resume, shape = self.params, (), self.shape
            if self.output_ids:
                resume = tuple(self.output_ids)
                seed = self.params.seed
                params = replace(
                    self.params,
                    prompt_logprobs=None,
                    seed=None if seed is None else migrated_seed(seed, len(resume)),
                )
                # The router predicts the prefill of the prompt and the resumed tokens.
                shape = replace(shape, prompt_tokens=shape.prompt_tokens + len(resume))
            self.gen = self.handle.generate.remote(
                self.request_id,
                self.prompt_token_ids,
                params,
                shape=shape,
                ingress=self.streams.ingress_id,
                resume=resume,
            )
            try:
                first = await self.gen.__anext__()
            except REPLICA_LOST as e:
                if self.attempts >= MAX_DISPATCH_ATTEMPTS:
                    raise ApiError(
                        503,
                        f"no replica could take the request: {e}",
                        code="replica_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)},
                    ) from e
                logger.warning("replica lost before accepting a request; re-sending: %s", e)
                continue
            if isinstance(first, Refused):
                self.done = True
            ok = accepted(first)
            if not resume:
                self.prompt_tokens = ok.prompt_tokens
            self.replica = ok.replica
            self._load(ok.load)
            self.streams.assign(self.request_id, self.replica)
            return

    async def items(self) -> AsyncIterator[StepItem]:
        """The replica's step items; if its replica dies, the request migrates to another
        (see the module docstring) and that replica's items follow.

        Raises:
            ReplicaLost: the request could not migrate (``n > 1``, or
                :data:`MAX_DISPATCH_ATTEMPTS` replicas failed it).
            ApiError: a request re-sent before its first token was refused (see
                :meth:`start`).
        """
        queue = self.streams.register(self.request_id)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, StreamLost) and item.replica not in ("", self.replica):
                    continue  # the stream of a replica the request already left
                if isinstance(item, StreamLost | Lost):
                    why = item.message if isinstance(item, Lost) else str(item)
                    self.gen.cancel()  # in case only the stream failed, not the replica
                    if isinstance(item, Lost):  # its engine failed: Serve will replace it
                        self._replica_died()
                    if getattr(item, "final", False):  # the server is stopping
                        self._failed()
                        raise ReplicaLost(why)
                    if not self._can_migrate():
                        self._failed()
                        raise ReplicaLost(f"the replica serving this request failed: {why}")
                    await self._migrate(why)
                    continue
                if item.error is not None:  # the request alone failed; its engine goes on
                    self.done = True
                    self._failed()
                    raise request_failed(item)
                if item.outputs:
                    self.produced = True
                    for o in item.outputs:
                        self.output_ids.extend(o.token_ids)
                self._observe(item)
                yield item
                if item.finished:
                    self.done = True
                    return
        finally:
            self.streams.forget(self.request_id)

    def _replica_died(self) -> None:
        view = load_view(self.handle.app_name, self.handle.deployment_name)
        if view is not None:
            view.replica_died(self.replica)

    def _can_migrate(self) -> bool:
        return self.attempts < MAX_DISPATCH_ATTEMPTS and (
            not self.produced or isinstance(self.params, PoolingParams) or self.params.n == 1
        )

    async def _migrate(self, why: str) -> None:
        """Send the request to another replica with the output it produced so far.

        Raises:
            ReplicaLost: no other replica is alive, or none accepted the request within
                :data:`MIGRATE_TIMEOUT_S` (or one refused it).
        """
        logger.warning(
            "replica %s of request %s lost after %d tokens; migrating: %s",
            self.replica,
            self.request_id,
            len(self.output_ids),
            why,
        )
        self.streams.leave(self.request_id, self.replica)
        view = load_view(self.handle.app_name, self.handle.deployment_name)
        if view is not None and not view.replica_ids():
            self._failed()
            raise ReplicaLost(
                f"the replica serving this request failed and no other is alive: {why}"
            )
        if self.produced:
            self.migrations += 1
        try:
            async with asyncio.timeout(MIGRATE_TIMEOUT_S):
                await self.start()
        except (ApiError, TimeoutError) as e:
            if self.gen is not None:
                self.gen.cancel()
            self._failed()
            raise ReplicaLost(f"the request could not move to another replica: {e}") from e

    def _load(self, load: LoadSnapshot | None) -> None:
        """Hand a load the replica sent with an item to this process's router."""
        if load is None:
            return
        view = load_view(self.handle.app_name, self.handle.deployment_name)
        if view is not None:
            view.observe_load(self.replica, load)

    def _observe(self, item: StepItem) -> None:
        self._load(item.load)
        if self.migrations and (item.cached_tokens is not None or item.queue_s is not None):
            # The first item of a migrated request: its prompt's cache and queue time
            # were the first replica's.
            item = replace(item, cached_tokens=None, queue_s=None)
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
    """The model deployment's replicas through Ray Serve (:class:`router.contract.Replicas`).

    Args:
        handle: the model deployment's handle.
    """

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle.options(stream=True)
        self.streams = StepStreams(self.handle, on_dead=self._replica_died)
        self._info_handle = handle
        self.stopping = False
        """Set by :meth:`drain`: new calls are refused."""

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
        params: SamplingParams | PoolingParams,
        shape: RequestShape,
        record: RequestRecord | None = None,
    ) -> RayCall:
        """The call of one prompt (:meth:`router.contract.Replicas.call`).

        Raises:
            ApiError: 503 with ``Retry-After`` once :meth:`drain` began.
        """
        if self.stopping:
            raise ApiError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return RayCall(
            self.handle, request_id, prompt_token_ids, params, shape, self.streams, record
        )

    async def drain(self, grace_s: float) -> int:
        """Stop taking requests (:meth:`call` answers 503), give the open ones up to
        ``grace_s`` seconds to finish, then end those still open: a stream with an error
        event and ``data: [DONE]``, a whole response with a 503. The requests ended so."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        while self.streams.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        cut = self.streams.open_requests
        if cut:
            logger.warning("ending %d open requests: the server is shutting down", cut)
            self.streams.end_all("the server is shutting down")
            await asyncio.sleep(0.5)  # their error events go out before the ingress stops
        return cut

    def _view(self) -> LoadView | None:
        return load_view(self.handle.app_name, self.handle.deployment_name)

    def _replica_died(self, replica: str) -> None:
        view = self._view()
        if view is not None:
            view.replica_died(replica)

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

    async def load_lora(self, lora: LoRARequest) -> None:
        """Load adapter ``lora`` on one replica, which checks it
        (:meth:`router.contract.Replicas.load_lora`); the others, and replicas started
        later, load it on its first request there.

        Raises:
            ApiError: 400 naming why the adapter cannot be served; 503 when no replica
                answers.
        """
        try:
            problem = await self._info_handle.load_lora.remote(lora)
        except REPLICA_LOST as e:
            raise ApiError(503, f"no model replica is ready: {e}", code="not_ready") from e
        if problem is not None:
            raise ApiError(400, problem, param="lora_path", code="invalid_value")

    async def unload_lora(self, name: str) -> None:
        """Have every running replica forget adapter ``name``, pinned to each; one that
        does not answer within :data:`UNLOAD_TIMEOUT_S` keeps it in host memory until it
        is evicted (no request can name it any more)."""
        view = self._view()
        if view is None:
            return
        calls = [
            self._info_handle.unload_lora.remote(name, pin=rid) for rid in view.replica_stats()
        ]
        if calls:
            await asyncio.wait(
                [asyncio.ensure_future(_quietly(c)) for c in calls], timeout=UNLOAD_TIMEOUT_S
            )

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


async def _quietly(response: Any) -> None:
    """Await ``response``; a replica that failed meanwhile is the replacement's business."""
    try:
        await response
    except Exception:  # noqa: BLE001 - best effort: the adapter is evicted in time anyway
        logger.debug("a replica did not take the call", exc_info=True)
