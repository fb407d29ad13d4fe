"""AsyncLLMEngine: the batching loop in the background, one async stream per request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.heap_trim import IdleRelease
from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from engine.core.request import CheckedRequest, RequestOutput
from engine.llm_engine import LLMEngine, PromptType
from policies import LoadSnapshot

logger = logging.getLogger(__name__)

IDLE_TICK_S = 0.01
"""Seconds to wait before re-trying a step that had nothing to schedule."""


class EngineDeadError(RuntimeError):
    """The background loop failed; the stream cannot finish."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (an exception in its own work or in the run of
    a step that held it; :meth:`engine.LLMEngine.step`). The message names the exception;
    the engine and its other requests go on."""


class EngineStoppedError(EngineDeadError):
    """The engine was shut down (:meth:`AsyncLLMEngine.shutdown`) before the stream
    finished, or before the request was queued."""


@dataclass(slots=True)
class _Pending:
    request_id: str
    checked: CheckedRequest
    """Checked by :meth:`AsyncLLMEngine.submit`; the worker adds it as is."""
    priority: int | None
    arrival_time: float


class AsyncLLMEngine:
    """Drives an :class:`LLMEngine` for an asyncio loop.

    The batching loop runs in one worker thread, the one :meth:`from_config` builds the
    engine on (torch releases the GIL, so the event loop keeps serving). It steps back to
    back while requests are unfinished and hands each step's outputs to the event loop
    (``call_soon_threadsafe``), which feeds the streams while the next step runs: the
    event loop's work per token (encoding and sending chunks) is never between two steps.
    Additions and aborts are queued under a lock and applied by the worker before its next
    step, so the engine is only ever touched by one thread. An abort thus takes effect,
    and frees the request's KV blocks, before the next step starts. The worker leaves when
    nothing is unfinished, and the next request starts it again.

    A request that fails inside a step ends its stream with :class:`RequestFailedError`;
    the loop goes on. Anything else the loop raises (the scheduler, a step hook, steps
    failing again and again: :class:`engine.llm_engine.EngineBrokenError`) ends it: every
    stream then raises :class:`EngineDeadError`, and so does every later request.
    """

    def __init__(
        self, engine: LLMEngine, executor: concurrent.futures.ThreadPoolExecutor | None = None
    ) -> None:
        """Wrap ``engine``; ``executor`` (one worker) steps it, a new one if None."""
        self.engine = engine
        # The worker thread detokenizes with the engine's tokenizer; this copy encodes
        # prompts on the event loop thread.
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._snapshot = engine.load_snapshot()
        """The load as of the end of the last step, or as after the step in flight while
        one runs (``LLMEngine.on_scheduled``); read by the event loop."""
        engine.on_scheduled = self._step_scheduled
        self._sent: LoadSnapshot | None = None
        """The snapshot :meth:`load_update` last returned a copy of."""
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._lock = threading.Lock()
        """Guards ``_to_add``, ``_to_abort``, ``_running`` and the ``_snapshot`` that
        counts the requests ``_to_add`` no longer holds."""
        self._to_add: list[_Pending] = []
        self._to_abort: list[str] = []
        self._running = False
        """The worker's batching loop is submitted and has not decided to leave."""
        self._stopping = False
        self._news = threading.Event()
        """Set when requests are queued or aborted; an idle tick waits on it."""
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="engine"
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: concurrent.futures.Future | None = None
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._idle_release = IdleRelease()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        """Build the engine on the worker thread that will step it (blocks until loaded).

        Why that thread: with torch's OpenMP backend (libgomp), every thread that runs a
        parallel op keeps its own team of worker threads alive. Once the process holds
        more such threads than CPUs, libgomp cuts its spin-wait short (``do_spin`` in
        libgomp's ``config/linux/wait.h`` switches to ``gomp_throttled_spin_count_var``
        when ``gomp_managed_threads > gomp_available_cpus``), so each op wakes its
        workers through the kernel. Loading on one thread and stepping on another
        makes steps slower (``bench/results/experiments/engine_thread.json``).

        Raises:
            Whatever :class:`LLMEngine` raises for the config.
        """
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        try:
            engine = executor.submit(LLMEngine.from_config, config).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, executor)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int | None = None,
        traffic_class: str | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as tokens arrive; the last has ``finished=True``.

        :meth:`submit` run when iteration starts. Leaving the iterator early (or cancelling
        the task that iterates) aborts the request.

        Raises:
            What :meth:`submit` and :meth:`RequestStream.__anext__` raise.
        """
        stream = self.submit(
            prompt,
            sampling_params,
            request_id,
            priority,
            traffic_class,
            resume_token_ids,
            lora_request,
        )
        try:
            async for item in stream:
                yield item
        finally:
            stream.close()

    def submit(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        priority: int | None = None,
        traffic_class: str | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request for the next step now; its stream of outputs.

        From this call on, :meth:`load_snapshot` counts the request as waiting, so that
        admission decisions made before its stream is first read see it. Each output is
        shaped by ``sampling_params.output_kind`` (all so far, by default; a streaming
        caller asks for ``DELTA``); a :class:`PoolingParams` request (an embedding) has
        one output, its last, with its ``embedding``. :meth:`RequestStream.close` before
        the last output, read or not, aborts the request.

        ``priority`` None means the traffic class's default; ``resume_token_ids``: the
        output the request already produced on a replica that died (see
        :meth:`LLMEngine.add_request`).

        Raises:
            ValueError, RequestRejectedError: bad prompt, parameters or traffic class;
                nothing is queued.
            EngineDeadError: the background loop failed.
            EngineStoppedError: the engine was shut down.
        """
        if self._error is not None:
            raise EngineDeadError("engine loop failed") from self._error
        if self._stopping:
            raise EngineStoppedError("the engine was shut down")
        params = sampling_params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in use")
        # The engine's one check of the request, here so that a bad one is refused before
        # its stream starts; the worker adds it without checking again.
        checked = self.engine.check(
            prompt, params, traffic_class, resume_token_ids, self._tokenizer, lora_request
        )
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[rid] = queue
        self._queue_news(add=_Pending(rid, checked, priority, self.engine.clock()))
        return RequestStream(self, rid, checked.prompt_token_ids, queue)

    def _stream_closed(self, rid: str, finished: bool) -> None:
        self._streams.pop(rid, None)
        if not finished:
            self._queue_news(abort=rid)

    def validate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams,
        traffic_class: str | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Check a request as :meth:`generate` will (:meth:`LLMEngine.check`), without
        queuing it.

        Returns:
            The prompt's token ids.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, unknown class, or
                resumed tokens the request cannot take (:meth:`LLMEngine.check_resume`).
            RequestRejectedError: prompt plus max_tokens exceeds the context or KV cache.
        """
        checked = self.engine.check(
            prompt, sampling_params, traffic_class, resume_token_ids, self._tokenizer
        )
        return checked.prompt_token_ids

    @property
    def dead(self) -> bool:
        """The background loop failed, or its worker thread is gone without a word (it
        left while it still had work: ``_running`` never cleared); no request can
        finish (the replica should restart). Read on the event loop."""
        if self._error is not None:
            return True
        worker = self._worker
        return worker is not None and worker.done() and self._running and not self._stopping

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load adapter ``lora`` (:meth:`LLMEngine.add_lora`) on a worker thread: reading
        it from disk must not hold the event loop.

        Raises:
            ValueError: the adapter cannot be served; the reason is the message.
        """
        await asyncio.to_thread(self.engine.add_lora, lora)

    def remove_lora(self, name: str) -> bool:
        """Forget adapter ``name`` (:meth:`LLMEngine.remove_lora`)."""
        return self.engine.remove_lora(name)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step."""
        self._queue_news(abort=request_id)

    def load_snapshot(self) -> LoadSnapshot:
        """The replica's load (queues per class, KV usage, fitted step-time model).

        The engine's state as of its last step or its last batch of additions, or as after
        the step running in the worker thread (the live queues are not read); requests
        queued for the next step count as waiting, so back-to-back admissions see each
        other. ``timestamp`` is the time of this call, and ``step_left_s`` what is left
        then of the running step's predicted time.
        """
        # Every request is counted exactly once: _snapshot was taken after the last
        # additions were applied (or after the last step), and _to_add holds the rest.
        # with_queued returns a new snapshot, and the worker replaces _snapshot whole
        # rather than mutating it, so no deep copy is needed.
        with self._lock:
            snap, queued = self._snapshot, list(self._to_add)
        snap = snap.with_queued(
            (p.checked.traffic_class, len(p.checked.prompt_token_ids)) for p in queued
        )
        now = time.time()
        return dataclasses.replace(
            snap, timestamp=now, step_left_s=max(0.0, snap.step_left_s - (now - snap.timestamp))
        )

    def load_update(self) -> LoadSnapshot | None:
        """:meth:`load_snapshot` when the engine's load changed since the last call that
        returned one (a step was scheduled or ran, or requests were added), else None.
        The replica sends it with its stream items: about one per step."""
        if self._snapshot is self._sent:
            return None
        self._sent = self._snapshot
        return self.load_snapshot()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def _queue_news(self, add: _Pending | None = None, abort: str | None = None) -> None:
        """On the event loop: queue an addition or an abort for the worker, and start its
        batching loop if it is not running."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            if add is not None:
                self._to_add.append(add)
            if abort is not None:
                self._to_abort.append(abort)
            start, self._running = not self._running, True
        self._news.set()
        if start and not self._stopping:  # a stream's abort may follow shutdown()
            try:
                self._worker = self._executor.submit(self._run)
            except RuntimeError as e:  # the executor is shut down: nothing can step
                logger.error("the engine's worker thread is gone: %s", e)
                self._error = e
                self._fail(e)

    def _apply_pending(self) -> None:
        """On the worker: apply the queued aborts and additions. The additions stay in
        ``_to_add`` (counted by :meth:`load_snapshot`) until the snapshot that counts them
        replaces ``_snapshot``."""
        engine = self.engine
        with self._lock:
            aborted, self._to_abort = set(self._to_abort), []
            self._to_add = [p for p in self._to_add if p.request_id not in aborted]
            adds = list(self._to_add)
        if aborted:
            engine.abort(list(aborted))
        for p in adds:
            try:
                engine.add_checked(p.request_id, p.checked, p.priority, p.arrival_time)
            except Exception as e:  # checked in submit(); a bug of its own fails it alone
                logger.error("request %s failed: %s", p.request_id, e, exc_info=e)
                self._deliver_soon([RequestFailedError(f"{type(e).__name__}: {e}")], p.request_id)
        snapshot = engine.load_snapshot()
        with self._lock:
            del self._to_add[: len(adds)]  # the event loop only appends
            self._snapshot = snapshot

    def _step_scheduled(self, snapshot: LoadSnapshot) -> None:
        self._snapshot = snapshot  # on the worker thread; replaced whole, never mutated

    def _step(self) -> list[RequestOutput]:
        """One engine step on the worker thread, and the load after it when no next step
        follows at once (while one does, its ``on_scheduled`` publishes the load, and a
        second snapshot per step would walk the queues twice for nothing)."""
        engine = self.engine
        outputs = engine.step()
        if not engine.has_unfinished_requests() or engine.last_step_num_tokens == 0:
            self._snapshot = engine.load_snapshot()
        return outputs

    def _has_news(self) -> bool:
        # Read without the lock as a hint; the worker decides to leave only under it.
        return bool(self._to_add or self._to_abort)

    def _run(self) -> None:
        """The batching loop, on the worker thread, until nothing is unfinished."""
        engine = self.engine
        try:
            while not self._stopping:
                self._news.clear()
                if self._has_news():
                    self._apply_pending()
                if not engine.has_unfinished_requests():
                    with self._lock:
                        if not self._has_news():
                            self._running = False
                            break
                    continue
                outputs = self._step()
                if outputs:
                    self._deliver_soon(outputs)
                if engine.last_step_num_tokens == 0:
                    # Nothing could run (e.g. the static policy is filling a batch): wait
                    # for news or a short tick instead of spinning on empty steps.
                    self._news.wait(IDLE_TICK_S)
        except BaseException as e:  # the engine is lost (SystemExit too): fail every stream
            logger.exception("engine loop failed")
            # Set here, before the streams hear of it: a generate() on the event loop
            # either sees it and raises, or has its stream in place when _fail runs.
            self._error = e
            self._call_soon(self._fail, e)
            return
        if not self._stopping:
            # Idle: the free holes a run of varied requests left in the C heap go back
            # to the system, rather than stay resident until the next run reuses them.
            self._idle_release.idle()

    def _deliver_soon(self, items: list, request_id: str | None = None) -> None:
        """Hand ``items`` (outputs, or an error for ``request_id``) to their streams on
        the event loop."""
        self._call_soon(self._deliver, items, request_id)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # that event loop has closed: its streams went with it
            pass

    def _deliver(self, items: list, request_id: str | None) -> None:
        for item in items:
            queue = self._streams.get(request_id or item.request_id)
            if queue is not None:
                queue.put_nowait(item)

    def _fail(self, error: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error)

    async def shutdown(self) -> None:
        """Stop the batching loop after the step in flight, and its worker thread; every
        unfinished stream then raises :class:`EngineStoppedError` (a caller still waiting
        on it would otherwise wait forever). Calling it again does nothing more."""
        self._stopping = True
        self._news.set()
        if self._worker is not None:
            await asyncio.wrap_future(self._worker)
        self._executor.shutdown(wait=True)
        self._fail(EngineStoppedError("the engine was shut down"))


class RequestStream:
    """One queued request's outputs (:meth:`AsyncLLMEngine.submit`), an async iterator.

    :meth:`close` (or leaving an ``async for`` over :meth:`AsyncLLMEngine.generate`)
    before the last output aborts the request, whether or not its stream was read.
    """

    def __init__(
        self,
        engine: AsyncLLMEngine,
        request_id: str,
        prompt_token_ids: list[int],
        queue: asyncio.Queue[RequestOutput | BaseException],
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        """The prompt as queued (its tokens, with any resumed output not included)."""
        self._queue = queue
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output.

        Raises:
            StopAsyncIteration: after the last output, or once closed.
            RequestFailedError: this request failed inside the engine.
            EngineDeadError: the background loop failed.
            EngineStoppedError: the engine was shut down.
        """
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
            if isinstance(item, EngineStoppedError):
                raise EngineStoppedError(*item.args)
            if isinstance(item, RequestFailedError):  # its addition failed
                raise RequestFailedError(*item.args)
            if isinstance(item, BaseException):
                raise EngineDeadError("engine loop failed") from item
            if item.error is not None:  # it ended in the engine, blocks freed
                self._finished = True
                raise RequestFailedError(f"the request failed in the engine: {item.error}")
        except BaseException:
            self.close()
            raise
        self._finished = item.finished
        if self._finished:
            self.close()
        return item

    def close(self) -> None:
        """Stop reading; abort the request if its last output has not arrived."""
        if self._closed:
            return
        self._closed = True
        self._engine._stream_closed(self.request_id, self._finished)
