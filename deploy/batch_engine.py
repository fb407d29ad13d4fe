"""A batch on engine replicas, no HTTP, no Serve: one in this process, or Ray actors.

A local run of one replica needs no cluster, so it runs the engine in the driver's
process, as vLLM's ``run_batch`` does: a Ray actor on the same cores competes with Ray's
own processes for them (docs/operations.md, "Engine replicas"). Several replicas, or a
cluster, take actors.

Each :class:`BatchWorker` owns one engine and answers each line through an ingress of its
own over that engine (:meth:`router.ingress.Ingress.answer`, over a
:class:`router.local.LocalReplicas`): the API's validation, dispatch and response building,
so a line's record is what ``POST /v1/...`` with ``x-iterserve-class: batch`` would
return for it. Its admission is off: the driver keeps each replica ``window`` requests
deep (twice its ``max_num_seqs``), so its engine always has waiting prompts to fill a
step's token budget with: the batch runs for throughput, at the ``batch`` class.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from deploy.batch_format import BATCH_CLASS
from deploy.engine_replica import EngineReplica
from engine.core.params import LoRARequest
from policies import make_classes
from router.ingress import Ingress
from router.local import LocalReplicas
from router.responses import Answer
from router.settings import IngressSettings
from router.tenants import CLASS_HEADER

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class BatchWorker:
    """One engine replica of a batch (in this process, or through ``ray.remote``).

    Args:
        engine_config: :class:`engine.EngineConfig` fields.
        model_name: the name the lines' ``model`` must carry.
        num_threads: torch intra-op threads (the CPUs Ray reserved for it).
        lora_adapters: LoRA adapters the lines may name as ``model``: name -> directory.

    Raises:
        ValueError: an adapter that cannot be served (before any line runs).
    """

    def __init__(
        self,
        engine_config: dict[str, Any],
        model_name: str,
        num_threads: int,
        lora_adapters: dict[str, str] | None = None,
    ) -> None:
        self.replica = EngineReplica(engine_config, num_threads, f"batch-{os.getpid()}")
        for name, path in (lora_adapters or {}).items():
            self.replica.engine.engine.add_lora(LoRARequest(name, path))
        self.engine = self.replica.engine
        config = self.engine.engine.config
        classes = {name: asdict(c) for name, c in make_classes(config.traffic_classes).items()}
        settings = IngressSettings(
            model_name=model_name,
            traffic_classes=classes,
            policy=config.policy_spec(),
            admission=False,
            lora_adapters=lora_adapters or {},
        )
        self.ingress = Ingress(LocalReplicas(self.replica), settings.model_dump())

    def ready(self) -> int:
        """The engine's ``max_num_seqs`` (the driver sizes its window with it)."""
        return self.engine.engine.config.max_num_seqs

    async def answer(self, url: str, body: dict[str, Any]) -> Answer:
        """Run one request to ``url`` (one of :data:`deploy.batch_format.URLS`) to the end,
        at the batch class; never raises for the request's own faults (its answer is then
        the API's error)."""
        return await self.ingress.answer(url, body, {CLASS_HEADER: BATCH_CLASS})


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
    plan: ReplicaPlan,
    engine_config: dict[str, Any],
    model_name: str,
    lora_adapters: dict[str, str] | None = None,
) -> list[RemoteBatchWorker]:
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
    cls = ray.remote(BatchWorker).options(**options)
    actors = [
        cls.remote(engine_config, model_name, max(1, math.floor(plan.num_cpus)), lora_adapters)
        for _ in range(plan.num_replicas)
    ]
    seqs = ray.get([a.ready.remote() for a in actors])
    return [RemoteBatchWorker(a, n) for a, n in zip(actors, seqs)]


class RemoteBatchWorker:
    """A :class:`BatchWorker` Ray actor, called as the in-process one is."""

    def __init__(self, actor: ActorHandle, max_num_seqs: int) -> None:
        self.actor = actor
        self.max_num_seqs = max_num_seqs

    def ready(self) -> int:
        """The actor engine's ``max_num_seqs``, read once when it started."""
        return self.max_num_seqs

    def answer(self, url: str, body: dict[str, Any]) -> Awaitable[Answer]:
        """:meth:`BatchWorker.answer` on the actor; await the returned object ref."""
        return self.actor.answer.remote(url, body)


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
    replicas: list[BatchWorker | RemoteBatchWorker],
    work: list[tuple[str, str, dict]],
    done: Callable[[str, Answer], None],
) -> None:
    """Answer every ``(custom_id, url, body)`` of ``work`` on ``replicas``; ``done`` is
    called (in this event loop) as each finishes, in completion order.

    Each replica gets ``2 * max_num_seqs`` requests in flight, pulled from one queue, so a
    faster replica takes more of the work.
    """
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)

    async def feed(replica: BatchWorker | RemoteBatchWorker) -> None:
        while not queue.empty():
            cid, url, body = queue.get_nowait()
            done(cid, await replica.answer(url, body))

    await asyncio.gather(*(feed(r) for r in replicas for _ in range(2 * r.ready())))
