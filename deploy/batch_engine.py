"""A batch on engine replicas, no HTTP, no Serve: one in this process, or Ray actors.

A local run of one replica needs no cluster, so it runs the engine in the driver's
process, as vLLM's ``run_batch`` does: a Ray actor on the same two cores ran the same
batch about 10% slower (docs/batch.md). Several replicas, or a cluster, take actors.

Each :class:`BatchReplica` owns one engine and answers whole requests with the API's own
code (:mod:`router.openai_format`, :mod:`router.responses`), so a line's body is what
``POST /v1/...`` would return for it. The driver keeps each replica ``window`` requests
deep (twice its ``max_num_seqs``), so its engine always has waiting prompts to fill a
step's token budget with: the batch runs for throughput, at the ``batch`` class.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from deploy.batch_format import BATCH_CLASS, Answer
from engine import AsyncLLMEngine, EngineConfig
from policies import make_classes
from router import openai_format as fmt
from router import responses
from router.errors import ApiError
from router.local import LocalCall
from router.routing import RequestShape
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.settings import IngressOptions
from router.tenants import resolve_caller

logger = logging.getLogger(__name__)

MAX_N: int = IngressOptions.model_fields["max_n"].default
"""Cap on one request's choices (``n`` times its prompts): the server's default."""


class BatchReplica:
    """One engine replica of a batch (in this process, or through ``ray.remote``).

    Args:
        engine_config: :class:`engine.EngineConfig` fields.
        model_name: the name the lines' ``model`` must carry.
        num_threads: torch intra-op threads (the CPUs Ray reserved for it).
    """

    def __init__(self, engine_config: dict[str, Any], model_name: str, num_threads: int) -> None:
        import torch

        torch.set_num_threads(max(1, num_threads))
        config = EngineConfig(**engine_config)
        self.engine = AsyncLLMEngine.from_config(config)
        self.tokenizer = self.engine.engine.tokenizer
        self.classes = make_classes(config.traffic_classes)
        self.model_name = model_name
        self.replica_id = f"batch-{os.getpid()}"

    def ready(self) -> int:
        """The engine's ``max_num_seqs`` (the driver sizes its window with it)."""
        return self.engine.engine.config.max_num_seqs

    async def answer(self, chat: bool, body: dict[str, Any]) -> Answer:
        """Run one request to the end; never raises for the request's own faults."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            return await self._answer(rid, chat, body)
        except ApiError as e:
            return Answer(e.status, rid, e.body())
        except Exception as e:  # a bug of ours: the line says so, the batch goes on
            logger.exception("batch request failed")
            return Answer(
                500, rid, ApiError(500, f"internal error: {e}", code="internal_error").body()
            )

    async def _answer(self, rid: str, chat: bool, body: dict[str, Any]) -> Answer:
        from deploy.engine_replica import engine_items

        req = fmt.validate(body, ChatCompletionRequest if chat else CompletionRequest)
        fmt.check_served(req, chat, self.model_name, MAX_N)
        caller = resolve_caller({}, self.classes, None, BATCH_CLASS, req.priority)
        prompts = fmt.prompts(req, chat, self.tokenizer)
        scores_only = fmt.scores_only(req, chat)
        params = fmt.sampling_params(req, chat)
        calls: list[responses.PromptCall] = []
        try:
            for p, (ids, text) in enumerate(prompts):
                shape = RequestShape(len(ids), caller.traffic_class, caller.priority)
                call = LocalCall(
                    engine_items(
                        self.engine,
                        self.replica_id,
                        rid if len(prompts) == 1 else f"{rid}-{p}",
                        ids,
                        params,
                        shape,
                        send_load=False,
                    )
                )
                calls.append(responses.PromptCall(ids, text, call))
                await call.start()
            reply = responses.Reply(
                req, chat, rid, self.model_name, self.tokenizer, calls, scores_only
            )
            out = await responses.collect(reply)
        finally:
            for c in calls:
                c.dispatch.cancel()
        return Answer(200, rid, out, out["usage"]["completion_tokens"])


@dataclass(slots=True)
class ReplicaPlan:
    """How many replicas, and what each reserves."""

    num_replicas: int
    num_cpus: float
    num_gpus: float


def plan_replicas(num_replicas: int | None, num_cpus: float | None, num_gpus: float) -> ReplicaPlan:
    """Fill in what was not given from the Ray cluster's alive nodes.

    Default CPUs per replica: a whole node's (the smallest node's), as ``iterserve serve``
    gives its one replica the host; 1 with GPUs, where the GPU does the work. Default
    count: as many as the nodes can place.

    Raises:
        ValueError: the cluster cannot place one replica, or the given count.
    """
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if num_cpus is None:
        num_cpus = 1.0 if num_gpus else float(max(1, int(min(n.get("CPU", 0) for n in nodes))))
    fits = sum(
        min(
            int(n.get("CPU", 0) // num_cpus),
            int(n.get("GPU", 0) // num_gpus) if num_gpus else 1 << 30,
        )
        for n in nodes
    )
    if num_replicas is None:
        num_replicas = fits
    if num_replicas < 1 or num_replicas > fits:
        raise ValueError(
            f"{num_replicas or 1} replicas of {num_cpus:g} CPUs and "
            f"{num_gpus:g} GPUs do not fit this cluster ({fits} do): lower "
            "--num-replicas, --replica-num-cpus or --replica-num-gpus"
        )
    return ReplicaPlan(num_replicas, num_cpus, num_gpus)


def start_replicas(
    plan: ReplicaPlan, engine_config: dict[str, Any], model_name: str
) -> list[ActorReplica]:
    """The replicas as Ray actors, once every one has loaded the model."""
    import ray

    options: dict[str, Any] = {
        "num_cpus": plan.num_cpus,
        "max_restarts": 2,
        "max_task_retries": 2,
        "max_concurrency": 4096,
    }
    if plan.num_gpus:
        options["num_gpus"] = plan.num_gpus
    cls = ray.remote(BatchReplica).options(**options)
    actors = [
        cls.remote(engine_config, model_name, max(1, math.floor(plan.num_cpus)))
        for _ in range(plan.num_replicas)
    ]
    seqs = ray.get([a.ready.remote() for a in actors])
    return [ActorReplica(a, n) for a, n in zip(actors, seqs)]


class ActorReplica:
    """A :class:`BatchReplica` Ray actor, called as the in-process one is."""

    def __init__(self, actor: Any, max_num_seqs: int) -> None:
        self.actor = actor
        self.max_num_seqs = max_num_seqs

    def ready(self) -> int:
        """The actor engine's ``max_num_seqs``, read once when it started."""
        return self.max_num_seqs

    def answer(self, chat: bool, body: dict[str, Any]) -> Awaitable[Answer]:
        """:meth:`BatchReplica.answer` on the actor; await the returned object ref."""
        return self.actor.answer.remote(chat, body)


def plan_local(num_cpus: float | None, num_gpus: float) -> ReplicaPlan:
    """One replica in this process: this process's CPUs unless ``num_cpus`` is given.

    Raises:
        ValueError: more CPUs or GPUs asked for than this machine has.
    """
    cpus = len(os.sched_getaffinity(0))
    if num_cpus is None:
        num_cpus = 1.0 if num_gpus else float(cpus)
    gpus = 0
    if num_gpus:
        import torch

        gpus = torch.cuda.device_count()
    if num_cpus > cpus or num_gpus > gpus:
        raise ValueError(
            f"a replica of {num_cpus:g} CPUs and {num_gpus:g} GPUs does not fit "
            f"this machine ({cpus} CPUs, {gpus} GPUs): lower --replica-num-cpus "
            "or --replica-num-gpus"
        )
    return ReplicaPlan(1, num_cpus, num_gpus)


async def run_on_replicas(
    replicas: list[BatchReplica | ActorReplica],
    work: list[tuple[str, bool, dict]],
    done: Callable[[str, Answer], None],
) -> None:
    """Answer every ``(custom_id, chat, body)`` of ``work`` on ``replicas``; ``done`` is
    called (in this event loop) as each finishes, in completion order.

    Each replica gets ``2 * max_num_seqs`` requests in flight, pulled from one queue, so a
    faster replica takes more of the work.
    """
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)

    async def feed(replica: BatchReplica | ActorReplica) -> None:
        while not queue.empty():
            cid, chat, body = queue.get_nowait()
            done(cid, await replica.answer(chat, body))

    await asyncio.gather(*(feed(r) for r in replicas for _ in range(2 * r.ready())))
