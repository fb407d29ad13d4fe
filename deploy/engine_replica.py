"""One engine replica without Ray: its engine, step metrics, limits and item stream.

:class:`EngineReplica` is what a model replica is wherever it runs: inside Ray Serve
(:class:`deploy.replica.ModelReplica` adds the Serve-facing calls) or in the server's own
process (``iterserve serve`` with one local replica, :mod:`deploy.local_server`).
:func:`engine_items` makes a request's items (:mod:`router.contract`) for both.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from engine import (
    AsyncLLMEngine,
    EngineConfig,
    LoRARequest,
    PoolingParams,
    RequestFailedError,
    RequestOutput,
    RequestOutputKind,
    RequestRejectedError,
    SamplingParams,
)
from engine.core.step_cost import LinearCost
from engine.core.step_drift import DriftMonitor
from engine.core.step_log import StepRecorder, engine_info
from engine.core.step_metrics import StepMetrics
from policies import LoadSnapshot
from router.contract import (
    Accepted,
    FirstItem,
    ModelInfo,
    Refused,
    RequestShape,
    SequenceDelta,
    StepItem,
)

logger = logging.getLogger(__name__)


class ProgressWatch:
    """Whether an engine that holds work still makes progress: the seconds since it last
    finished a step, or was seen idle, while it had unfinished requests.

    :meth:`stepped` is called on the engine's thread after every step that ran;
    :meth:`stalled_s` by the health check, which sees the engine idle at least once per
    period: a request arriving after a long idle spell is thus counted from at most one
    period before it came.

    Args:
        unfinished: the engine's unfinished requests now.
        clock: seconds, monotonic.
    """

    def __init__(self, unfinished: Callable[[], int], clock: Callable[[], float] = time.monotonic):
        self._unfinished = unfinished
        self._clock = clock
        self._progress = clock()

    def stepped(self, *_: object) -> None:
        """A step finished (a step listener)."""
        self._progress = self._clock()

    def stalled_s(self) -> float:
        """Seconds without a finished step while requests were unfinished; 0 when idle."""
        now = self._clock()
        if self._unfinished() == 0:
            self._progress = now
            return 0.0
        return max(0.0, now - self._progress)


class EngineReplica:
    """One engine replica (a :class:`router.local.LocalReplica` for an ingress in its
    process).

    Args:
        engine_config: :class:`engine.EngineConfig` fields.
        num_threads: torch intra-op threads; the CPUs reserved for this replica, so
            replicas sharing a machine do not oversubscribe it (oversubscribed OpenMP
            threads wait at barriers for preempted peers: docs/operations.md, "Few cores").
        replica_id: the id the ingress knows this replica by.
        step_log: a JSONL file to append the step log to (:mod:`engine.core.step_log`).
        step_history: step-log records kept in memory (``GET /steps``); with 0 and no
            ``step_log``, nothing is recorded and :attr:`recorder` is None.
        service: the service config, for the step log's header (a replay of the log
            runs under it).
        twin_cost: the simulator's step-time model that :attr:`drift` checks the
            measured steps against; None: it fits its own on the first steps.

    Raises:
        OSError: ``step_log`` cannot be opened for appending.
    """

    def __init__(
        self,
        engine_config: dict[str, Any],
        num_threads: int,
        replica_id: str,
        step_log: str | None = None,
        step_history: int = 0,
        service: dict[str, Any] | None = None,
        twin_cost: LinearCost | None = None,
    ) -> None:
        torch.set_num_threads(max(1, num_threads))
        self.engine = AsyncLLMEngine.from_config(EngineConfig(**engine_config))
        self.step_metrics = StepMetrics()
        self.engine.engine.add_step_listener(self.step_metrics.record)
        self.recorder: StepRecorder | None = None
        if step_log is not None or step_history > 0:
            info = engine_info(self.engine.engine) | ({"service": service} if service else {})
            self.recorder = StepRecorder(info, step_log, step_history)
            self.recorder.attach(self.engine.engine)
        self.drift = DriftMonitor(twin_cost, clock=self.engine.engine.clock)
        self.drift.attach(self.engine.engine)
        self.progress = ProgressWatch(lambda: self.engine.num_unfinished)
        self.engine.engine.add_step_listener(self.progress.stepped)
        self.replica_id = replica_id
        logger.info("replica ready (pid %d, %d torch threads)", os.getpid(), num_threads)

    def info(self) -> ModelInfo:
        """What the ingress needs once: the tokenizer, the limits, how the weights are
        held and what embeddings the engine computes."""
        engine = self.engine.engine
        w = engine.weights
        return ModelInfo(
            engine.tokenizer,
            engine.limits,
            w.format if w is not None else "",
            w.bytes if w is not None else 0,
            embedding_size=engine.embedding_size,
            embedding_pooling=engine.config.embedding_pooling,
            embedding_dimensions=tuple(engine.config.embedding_dimensions or ()),
        )

    def items(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        shape: RequestShape,
        send_load: bool = True,
        resume: Sequence[int] = (),
    ) -> AsyncGenerator[FirstItem | StepItem, None]:
        """One request's items (:func:`engine_items`) on this replica's engine."""
        return engine_items(
            self.engine,
            self.replica_id,
            request_id,
            prompt_token_ids,
            params,
            shape,
            send_load,
            resume,
        )

    async def load_lora(self, lora: LoRARequest) -> str | None:
        """Load adapter ``lora`` now; None, or why it cannot be served (the ingress's 400:
        a message crosses Ray Serve as it is, where an exception would be wrapped)."""
        try:
            await self.engine.add_lora(lora)
        except ValueError as e:
            return str(e)
        return None

    def unload_lora(self, name: str, pin: str | None = None) -> bool:
        """Forget adapter ``name``; True if it was loaded. ``pin``: this replica's id, by
        which the ingress sends the call to each replica (Ray Serve's request router)."""
        return self.engine.remove_lora(name)

    def record_routing_stats(self) -> dict[str, Any]:
        """The load snapshot and, under ``"metrics"``, :class:`engine.core.step_metrics.StepMetrics`
        plus the prefix cache's lookups and hits since start, in tokens, and the twin's
        drift (``"step_time_prediction"``: :meth:`engine.core.step_drift.DriftMonitor.to_dict`).
        Ray Serve polls it from a served replica; the ingress's admission, routing and
        ``/metrics`` read it."""
        bm = self.engine.engine.block_manager
        metrics = {
            **self.step_metrics.to_dict(),
            "prefix_cache_queries": bm.num_queried_tokens,
            "prefix_cache_hits": bm.num_hit_tokens,
            "step_time_prediction": self.drift.to_dict(),
        }
        return {**self.engine.load_snapshot().to_dict(), "metrics": metrics}


async def engine_items(
    engine: AsyncLLMEngine,
    replica_id: str,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams | PoolingParams,
    shape: RequestShape,
    send_load: bool = True,
    resume: Sequence[int] = (),
) -> AsyncGenerator[FirstItem | StepItem, None]:
    """Run one request on ``engine``; yield the items the ingress turns into OpenAI chunks.

    ``params`` go to the engine as they are: built and checked by the ingress
    (:func:`router.openai_format.sampling_params`), with ``DELTA`` outputs, which the step
    items need (each carries one step's tokens); or an embedding's
    :class:`engine.PoolingParams`, whose one step item carries its vector. The engine
    checks what only it can (the vocabulary, its context and KV capacity, a
    ``json_schema``'s grammar, the embedding ``dimensions`` it serves), once.

    The first item is :class:`router.contract.Accepted` once the request is queued, or a
    :class:`router.contract.Refused` (and nothing more) if the engine refuses it (context
    or KV capacity, a bad parameter), so a 400 can be answered before any stream starts.
    Then one :class:`router.contract.StepItem` per step that produced tokens, with this
    step's deltas; the first of these also has ``queue_s`` and ``cached_tokens``.

    With ``send_load``, any item may also carry ``load``: the engine's load snapshot when
    it changed since the replica last sent one (``AsyncLLMEngine.load_update``), so that
    an ingress in another process sees the replica's load step by step. An ingress in the
    engine's process reads the engine's snapshot itself and passes False.

    ``resume``: the output tokens the request already produced on a replica that died
    (:mod:`router.dispatch` migrates it); the items hold only what follows them.

    A request that fails inside the engine (:class:`engine.RequestFailedError`; the engine
    goes on) ends with a ``finished`` step item whose ``error`` says why.

    Closing or cancelling the iteration aborts the engine request before its next step.
    """
    if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.DELTA:
        # not the ingress's: a test's, say
        params = replace(params, output_kind=RequestOutputKind.DELTA)
    try:
        # Queued before Accepted: admission reads the engine's load, and a burst of
        # requests admitted before any of their streams is read must each count in it.
        outs = engine.submit(
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=shape.priority,
            traffic_class=shape.traffic_class,
            resume_token_ids=resume,
            lora_request=shape.lora,
        )
    except RequestRejectedError as e:
        yield Refused(str(e), "context_length_exceeded", param="prompt")
        return
    except ValueError as e:  # the engine's checks; ParamError names the request field
        yield Refused(str(e), "invalid_value", param=getattr(e, "param", None))
        return
    first = True
    try:
        yield Accepted(len(outs.prompt_token_ids), replica_id, _load(engine, send_load))
        async for out in outs:
            item = _step_item(engine, out, first, send_load)
            first = False
            yield item
    except RequestFailedError as e:
        yield StepItem([], True, error=str(e), load=_load(engine, send_load))
    finally:
        outs.close()  # an early close aborts the engine request now, not at GC


def _step_item(
    engine: AsyncLLMEngine, out: RequestOutput, first: bool, send_load: bool
) -> StepItem:
    """The step item of one engine output (``queue_s`` and ``cached_tokens`` if ``first``)."""
    outputs = [
        SequenceDelta(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
        for c in out.outputs
        if c.text or c.token_ids or c.finish_reason
    ]
    queue_s = cached = None
    if first:
        m = out.metrics
        cached = out.num_cached_tokens
        if m.first_scheduled_time is not None:
            queue_s = m.first_scheduled_time - m.arrival_time
    return StepItem(
        outputs,
        out.finished,
        queue_s=queue_s,
        cached_tokens=cached,
        prompt_logprobs=out.prompt_logprobs,
        load=_load(engine, send_load),
        embedding=out.embedding,
    )


def _load(engine: AsyncLLMEngine, send_load: bool) -> LoadSnapshot | None:
    return engine.load_update() if send_load else None
