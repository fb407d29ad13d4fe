"""LLMEngine: add requests, step the batching loop, collect incremental outputs."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.heap_trim import release_free_memory
from engine.core.interfaces import (
    FinishRecord,
    ModelRunner,
    PooledResult,
    SampleResult,
    StepRecord,
    StepResult,
)
from engine.core.kv_cache import BlockManager
from engine.core.outputs import RequestGroup, make_output
from engine.core.params import (
    LoRARequest,
    ParamError,
    PoolingParams,
    RequestOutputKind,
    SamplingParams,
)
from engine.core.request import (
    CheckedRequest,
    CompletionOutput,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
)
from engine.core.schedule_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.model.detokenizer import IncrementalDetokenizer
from engine.model.structured import StructuredOutput
from policies import DEFAULT_CLASS, LoadSnapshot, make_classes
from policies.limits import RequestLimits

if TYPE_CHECKING:
    from engine.model.attention_backend import FlashAttnVarlenFunc

RECENT_STEPS = 8
"""Steps averaged into ``LoadSnapshot.recent_step_s`` (a few, so it follows bursts)."""

MAX_FAILED_STEPS = 3
"""Consecutive steps whose run may raise before :meth:`LLMEngine.step` gives up
(:class:`EngineBrokenError`): one failed step fails only its requests, but a run that fails
again and again, whatever it holds, means the runner itself is broken."""

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict


class EngineBrokenError(RuntimeError):
    """:data:`MAX_FAILED_STEPS` steps in a row failed to run: the engine cannot go on."""


@dataclass(slots=True)
class _Scheduled:
    """A step as :meth:`LLMEngine._schedule` planned it; seconds on the engine's clock."""

    out: SchedulerOutput
    start: float
    schedule_s: float
    predicted_s: float
    """The step-time model's prediction (0 without step listeners: nobody reads it)."""


@dataclass(slots=True)
class _Update:
    """What :meth:`LLMEngine._update` did to a step's requests."""

    got: list[Request]
    """The requests that got a token, in the step's order."""
    deltas: dict[str, tuple[str, int]]
    """Per sequence id that advanced: ``(new text, new tokens)`` (see ``make_output``)."""
    failed: dict[str, Exception]
    """Per caller request id: the first exception of its sequences' own work."""
    now: float
    """When the step's tokens were taken, on the engine's clock."""


class LLMEngine:
    """One replica's engine: scheduler, KV block manager, model runner, detokenizer.

    Not thread-safe: one caller drives ``add_request``/``step``/``abort``
    (``AsyncLLMEngine`` serialises them onto its loop).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: ModelRunner,
        tokenizer,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
        model_dir: str | None = None,
    ) -> None:
        """Assemble an engine from its parts (:meth:`from_config` loads the model).

        Args:
            runner: executes steps (:class:`engine.core.interfaces.ModelRunner`); its KV cache
                size, context length, vocabulary and EOS ids are the engine's.
            tokenizer: a transformers tokenizer of the runner's model.
            scheduler: None: ``Scheduler.from_config`` over ``runner.num_kv_blocks``
                blocks, on ``clock``.
            clock: seconds; every time the engine records (arrivals, tokens, step
                durations for the step-time model) is read from it, so a fake clock
                and a fake runner replay a run exactly.
            model_dir: where the model came from, for logs.
        """
        self.config = config
        self.clock = clock
        self.runner = runner
        self.tokenizer = tokenizer
        self.structured = StructuredOutput(tokenizer, runner.vocab_size)
        self.model_dir = model_dir
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        self.eos_token_ids = set(runner.eos_token_ids)
        self.embedding_size: int = getattr(runner, "hidden_size", 0)
        """The size of an embedding request's full vector (the model's hidden size); 0:
        the runner pools nothing, and embedding requests are refused."""
        too_big = [d for d in config.embedding_dimensions or () if d > self.embedding_size]
        if too_big and self.embedding_size:
            raise ValueError(
                f"embedding_dimensions {too_big} exceed the model's hidden size "
                f"{self.embedding_size}"
            )
        self.scheduler = scheduler or Scheduler.from_config(
            config,
            BlockManager(
                runner.num_kv_blocks,
                config.block_size,
                config.enable_prefix_caching,
                cache_salt=f"{config.model}:{config.dtype}",
            ),
            clock,
        )
        self.block_manager = self.scheduler.block_manager
        self.step_time_model = self.scheduler.step_time
        self.traffic_classes = make_classes(config.traffic_classes)
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        """Called in order after every step that ran, each once with its
        :class:`StepRecord` (step metrics, the step log, the drift monitor); on the thread
        that steps the engine. One that raises ends :meth:`step` with its exception: the
        listeners after it miss that step, and the step's outputs are lost."""
        self.on_finish: Callable[[FinishRecord], None] | None = None
        """Called once for every request that ends (finished, stopped, aborted), with its
        :class:`FinishRecord` (step logs); on the thread that steps the engine."""
        self.on_scheduled: Callable[[LoadSnapshot], None] | None = None
        """Called in every step between scheduling and running it, with the load as after
        the step (``load_snapshot(in_flight=...)``): the replica publishes that while the
        step runs. On the thread that steps the engine."""
        self._recent_step_s: deque[float] = deque(maxlen=RECENT_STEPS)
        self._groups: dict[str, RequestGroup] = {}
        self._num_steps = 0
        self._failed_steps = 0
        """Consecutive steps whose run raised (see :data:`MAX_FAILED_STEPS`)."""
        self.last_step_num_tokens = 0
        """Tokens the last ``step()`` ran (0: it had nothing to schedule)."""

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        flash_attn_varlen_func: FlashAttnVarlenFunc | None = None,
    ) -> LLMEngine:
        """Load ``config.model`` onto a :class:`engine.model.runner.TorchModelRunner` and
        build the engine around it. ``flash_attn_varlen_func`` replaces flash-attn's own
        function on the ``flash_attn`` attention backend (a test's reference kernel).

        Raises:
            ModelLoadError: missing model or unsupported architecture.
            ValueError: the KV cache budget holds no block, or the attention backend
                cannot run here.
        """
        from engine.model.runner import TorchModelRunner

        runner, tokenizer, model_dir = TorchModelRunner.load(config, flash_attn_varlen_func)
        engine = cls(
            config, runner=runner, tokenizer=tokenizer, clock=clock, model_dir=str(model_dir)
        )
        release_free_memory()  # the load's temporaries, freed, would stay resident
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d, %s, %s attention",
            model_dir,
            runner.num_kv_blocks,
            config.block_size,
            engine.max_model_len,
            runner.device,
            runner.attention.name,
        )
        return engine

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    @property
    def weights(self):
        """How the model holds its weights (:class:`engine.model.loader.WeightInfo`), or None
        for a runner that does not say (a test's fake)."""
        return getattr(self.runner, "weights", None)

    # -- LoRA adapters -------------------------------------------------------------------

    def lora_adapter(self, lora: LoRARequest):
        """The adapter ``lora`` names (:class:`engine.lora.LoRAAdapter`), read from its
        directory unless this engine keeps it already.

        Raises:
            ValueError: the adapter cannot be served (:class:`engine.lora.AdapterError`
                says why), or this engine's runner serves no adapters.
        """
        manager = getattr(self.runner, "lora", None)
        if manager is None:
            raise ValueError(f"adapter {lora.name!r}: this model's runner serves no adapters")
        return manager.get(lora)

    def add_lora(self, lora: LoRARequest) -> None:
        """Load adapter ``lora`` now (vLLM's ``add_lora``); requests may also name an
        adapter that was never added, which loads it on first use.

        Raises:
            ValueError: as :meth:`lora_adapter`.
        """
        self.lora_adapter(lora)

    def remove_lora(self, name: str) -> bool:
        """Forget adapter ``name``; requests running with it finish with it. True if it
        was loaded."""
        manager = getattr(self.runner, "lora", None)
        return manager is not None and manager.remove(name)

    def list_loras(self) -> list[str]:
        """The adapters this engine keeps loaded, least recently used first."""
        manager = getattr(self.runner, "lora", None)
        return manager.loaded() if manager is not None else []

    @property
    def limits(self) -> RequestLimits:
        """What this engine can ever run; the replica hands it to the ingress."""
        return RequestLimits(
            self.max_model_len,
            self.kv_capacity_tokens,
            self.config.max_num_batched_tokens,
            self.config.enable_chunked_prefill,
        )

    def tokenize(self, prompt: PromptType, tokenizer=None) -> tuple[str | None, list[int]]:
        """Return ``(prompt text or None, prompt token ids)``.

        ``tokenizer`` overrides the engine's, for callers on another thread (a fast
        tokenizer must not be used from two threads at once).

        Raises:
            ValueError: empty prompt, or a token id outside the vocabulary.
        """
        tokenizer = tokenizer or self.tokenizer
        if isinstance(prompt, dict):
            if not {"prompt_token_ids", "prompt"} & prompt.keys():
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            text, ids = prompt, tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        return text, ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams | None = None,
        priority: int | None = None,
        traffic_class: str | None = None,
        arrival_time: float | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next step that has room.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": str}``.
            sampling_params: default ``SamplingParams()``; a :class:`PoolingParams` makes
                it an embedding request (one output, finished, with its ``embedding``).
            priority: lower is more urgent; None: the traffic class's default priority.
            traffic_class: a configured class (default ``standard``).
            arrival_time: seconds on the engine's clock; default now.
            resume_token_ids: output tokens this request already produced elsewhere (a
                replica that died: :class:`router.dispatch.RayCall` migrates it). The
                request starts as one preempted by recompute would: these tokens count
                as its output (``max_tokens``, ``min_tokens``, penalties, its grammar)
                and are prefilled with the prompt, and its detokenizer has read them, so
                its first text delta continues the text they made (a character or a
                stop string spanning the boundary included). Their text is not sent
                again. Only for ``n == 1``.
            lora_request: the LoRA adapter to generate with; None: the base model.

        Raises:
            ValueError: duplicate id, empty prompt or unknown traffic class; resumed
                tokens with ``n > 1``, outside the vocabulary, or not under
                ``max_tokens`` (see :meth:`check`); an adapter that cannot be served
                (:class:`engine.lora.AdapterError`); an embedding request with resumed
                tokens, or with ``dimensions`` this model does not serve (``ParamError``),
                or on a runner that pools nothing.
            RequestRejectedError: prompt plus max_tokens exceeds the model's context or the
                whole KV cache, so it could never run.
        """
        params = sampling_params or SamplingParams()
        checked = self.check(prompt, params, traffic_class, resume_token_ids, lora=lora_request)
        self.add_checked(request_id, checked, priority, arrival_time)

    def check(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        traffic_class: str | None = None,
        resume_token_ids: Sequence[int] = (),
        tokenizer=None,
        lora: LoRARequest | None = None,
    ) -> CheckedRequest:
        """Check a request as :meth:`add_request` does, without queuing it: the engine's
        one check of a request (``params`` checked their own ranges when built). For a
        caller that checks on one thread and adds on another (:class:`engine.AsyncLLMEngine`
        answers a bad request at once, and adds it on the thread that steps):
        :meth:`add_checked` then checks nothing again.

        Args:
            traffic_class: None: the default class.
            tokenizer: see :meth:`tokenize`.
            lora: the request's adapter, read now if it is not kept already.

        Raises:
            ValueError, RequestRejectedError: as :meth:`add_request` (but the duplicate id).
        """
        traffic_class = traffic_class or DEFAULT_CLASS
        text, ids, max_tokens = self.validate(prompt, params, traffic_class, tokenizer)
        if resume_token_ids:
            if isinstance(params, PoolingParams):
                raise ValueError("an embedding request has no output to resume")
            self.check_resume(resume_token_ids, params, max_tokens)
        key = self.lora_adapter(lora).key if lora is not None else b""
        return CheckedRequest(
            text, ids, params, traffic_class, max_tokens, tuple(resume_token_ids), lora, key
        )

    def add_checked(
        self,
        request_id: str,
        checked: CheckedRequest,
        priority: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request that :meth:`check` passed (arguments as :meth:`add_request`).

        Raises:
            ValueError: duplicate id, or resumed tokens that already end at a stop string.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if priority is None:
            priority = self.traffic_classes[checked.traffic_class].default_priority
        now = self.clock() if arrival_time is None else arrival_time
        if isinstance(checked.params, PoolingParams):
            self._add_pooling(request_id, checked, priority, now)
            return
        params, ids, max_tokens = checked.params, checked.prompt_token_ids, checked.max_tokens
        traffic_class, resume_token_ids = checked.traffic_class, checked.resume_token_ids
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            cls = self.traffic_classes[traffic_class]
            req = Request(
                seq_id,
                ids,
                params,
                now,
                max_tokens,
                priority=priority,
                traffic_class=traffic_class,
                parent_id=request_id,
                index=i,
                lora=checked.lora,
                lora_key=checked.lora_key,
                ttft_slo_s=cls.ttft_slo_s,
                tpot_slo_s=cls.tpot_slo_s,
            )
            if params.seed is not None and params.n > 1:
                req.params = replace(params, seed=params.seed + i)
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
            if params.prompt_logprobs is not None and i == 0:
                req.prompt_logprobs = [None]
            req.grammar = self.structured.for_params(params)
            if resume_token_ids:
                self._resume(req, list(resume_token_ids))
            seqs.append(req)
        self._groups[request_id] = RequestGroup(
            request_id, checked.prompt_text, seqs, now, params.output_kind
        )
        for req in seqs:
            self.scheduler.add(req)

    def _add_pooling(
        self, request_id: str, checked: CheckedRequest, priority: int, now: float
    ) -> None:
        """Queue an embedding request: one sequence that samples nothing (its
        ``params`` are defaults no step reads) and has one output, when it finishes."""
        cls = self.traffic_classes[checked.traffic_class]
        req = Request(
            request_id,
            checked.prompt_token_ids,
            SamplingParams(),
            now,
            0,
            priority=priority,
            traffic_class=checked.traffic_class,
            parent_id=request_id,
            lora=checked.lora,
            lora_key=checked.lora_key,
            ttft_slo_s=cls.ttft_slo_s,
            tpot_slo_s=cls.tpot_slo_s,
            pooling=checked.params,
        )
        req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self._groups[request_id] = RequestGroup(
            request_id, checked.prompt_text, [req], now, RequestOutputKind.FINAL_ONLY
        )
        self.scheduler.add(req)

    def check_resume(
        self, resume_token_ids: Sequence[int], params: SamplingParams, max_tokens: int
    ) -> None:
        """Check the output tokens a migrated request resumes with (see
        :meth:`add_request`) against its parameters and effective ``max_tokens``.

        Raises:
            ValueError: ``n > 1``, a token id outside the vocabulary, or as many tokens
                as ``max_tokens`` (the request had finished).
        """
        if params.n != 1:
            raise ValueError("only a request with n == 1 can resume its output")
        if len(resume_token_ids) >= max_tokens:
            raise ValueError(
                f"{len(resume_token_ids)} resumed tokens leave none of max_tokens={max_tokens}"
            )
        bad = [t for t in resume_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"resumed token id {bad[0]} is outside the vocabulary")

    def _resume(self, req: Request, tokens: list[int]) -> None:
        """Give a new request the output it produced elsewhere, as if it had been
        preempted by recompute after producing it (see :meth:`add_request`)."""
        for t in tokens:
            req.append_token(t)
            if req.grammar is not None:
                req.grammar.accept_token(t)
        # The detokenizer reads them as the first replica's did step by step (stop
        # strings not looked for until min_tokens), so it holds back the same text: a
        # partial character, or a tail that may begin a stop string.
        free = max(0, min(req.params.min_tokens - 1, len(tokens)))
        stop = None
        if free:
            req.detokenizer.update(tokens[:free], check_stop=False)
        if len(tokens) > free:
            _, stop = req.detokenizer.update(tokens[free:])
        if stop is not None:
            raise ValueError(f"the resumed output already ends at stop string {stop!r}")

    def check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        """The effective max_tokens under :attr:`limits` (see ``RequestLimits.check``).

        Raises:
            RequestRejectedError: the request could never run here.
        """
        return self.limits.check(prompt_len, max_tokens)

    def validate(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        traffic_class: str | None = None,
        tokenizer=None,
    ) -> tuple[str | None, list[int], int]:
        """:meth:`check` but for resumed tokens: ``(prompt text or None, prompt token ids,
        effective max_tokens)`` (``tokenizer``: see :meth:`tokenize`; max_tokens 0 for
        an embedding request).

        Raises:
            ValueError: unknown traffic class, empty prompt or a token id outside the
                vocabulary (:class:`ParamError` for ``logit_bias`` and ``stop_token_ids``),
                or a ``json_schema`` or ``structural_tag`` that does not compile
                (``ParamError``); an embedding request with ``dimensions`` not served
                (``ParamError``) or on a runner that pools nothing.
            RequestRejectedError: the request could never run here.
        """
        if traffic_class is not None and traffic_class not in self.traffic_classes:
            raise ValueError(
                f"unknown traffic_class {traffic_class!r}; known: {sorted(self.traffic_classes)}"
            )
        if isinstance(params, PoolingParams):
            self.check_pooling(params)
            text, ids = self.tokenize(prompt, tokenizer)
            return text, ids, self.check_length(len(ids), 0)
        vocab = self.runner.vocab_size
        for name, token_ids in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ParamError(
                    name, f"{name}: token id {bad[0]} is outside the vocabulary (ids 0-{vocab - 1})"
                )
        self.structured.check(params)
        text, ids = self.tokenize(prompt, tokenizer)
        return text, ids, self.check_length(len(ids), params.max_tokens)

    def check_pooling(self, params: PoolingParams) -> None:
        """Whether this engine serves an embedding request with ``params``.

        Raises:
            ValueError: the runner pools nothing.
            ParamError: ``dimensions`` is neither the hidden size nor one of
                ``embedding_dimensions``.
        """
        if not self.embedding_size:
            raise ValueError("this engine's runner computes no embeddings")
        d = params.dimensions
        served = self.config.embedding_dimensions or []
        if d is None or d == self.embedding_size or d in served:
            return
        if served:
            why = f"they can be cut to {sorted(served)} only"
        else:
            why = (
                "they cannot be cut (embedding_dimensions lists the sizes a "
                "Matryoshka-trained model supports)"
            )
        raise ParamError(
            "dimensions",
            f"dimensions={d}: this model's embeddings are {self.embedding_size} long; {why}",
        )

    def abort(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Finish requests with reason ``abort`` and free their KV blocks at once.

        Unknown or finished ids are ignored. Returns the aborted requests' final outputs
        (for every output kind).
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        now = self.clock()
        outs = []
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            aborted = {r.request_id: ("", 0) for r in group.seqs if not r.is_finished}
            for req in group.seqs:
                if not req.is_finished:
                    self.scheduler.finish(req, FinishReason.ABORT, now)
            outs.append(make_output(group, aborted))
            self._finished(group)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one iteration, in four parts: schedule (:meth:`_schedule`), run
        (:meth:`_run`), update the requests (:meth:`_update`), make their outputs
        (:meth:`_outputs`); then the step's record goes to the listeners
        (:meth:`_record_step`).

        A failure stays with the requests it concerns. An exception in one request's own
        work (its logits processors or grammar in the sampler, its grammar's advance, its
        detokenization, its output) fails that request alone; one in the step's run (the
        model's forward) fails the step's requests. A failed request ends at once, its KV
        blocks freed, with a last output whose ``error`` says what was raised (finish
        reason ``error``); the other requests go on.

        Returns:
            An output for each request that got a token or failed, shaped by its
            ``SamplingParams.output_kind``; a finished request's last output has
            ``finished=True``.

        Raises:
            EngineBrokenError: the run raised in :data:`MAX_FAILED_STEPS` steps in a row.
            Whatever the scheduler raises (its state is then unknown: the engine is lost),
            and whatever ``on_scheduled`` or a step listener raises.
        """
        step = self._schedule()
        if step is None:
            return []
        try:
            samples = self._run(step.out)
        except Exception as e:  # the batch's forward: no request to pin it on
            return self._step_failed(step.out, e)
        update = self._update(step.out, samples)
        outputs = self._outputs(update)
        self._record_step(step, update.now)
        return outputs

    def _schedule(self) -> _Scheduled | None:
        """Schedule: plan the step (which requests run which tokens; KV blocks allocated),
        timed on the engine's clock, and publish the load as after it (``on_scheduled``).
        None: nothing to run."""
        start = self.clock()
        out = self.scheduler.schedule(start)
        schedule_s = self.clock() - start
        self.last_step_num_tokens = out.num_batched_tokens
        if out.is_empty:
            return None
        predicted = self._predict(out) if self.step_listeners else 0.0
        if self.on_scheduled is not None:
            self.on_scheduled(self.load_snapshot(out))
        return _Scheduled(out, start, schedule_s, predicted)

    def _run(self, out: SchedulerOutput) -> dict[str, StepResult]:
        """Run: the model executes the step; the sampled token of each request whose chunk
        reached its last token, by request id.

        Raises:
            Whatever the runner raises (:meth:`step` then fails the step's requests).
        """
        samples = self.runner.execute(out)
        self._failed_steps = 0
        return samples

    def _update(self, out: SchedulerOutput, samples: dict[str, StepResult]) -> _Update:
        """Update: the scheduler takes the sampled tokens, then each request that got one
        advances (:meth:`_advance`: grammar, logprobs, text, stop), and each embedding
        request whose prompt is done finishes with its vector. A request whose own work
        raised is kept in ``failed`` (the first error of its caller request) and the
        others go on."""
        tokens = {rid: s.token_id for rid, s in samples.items() if isinstance(s, SampleResult)}
        got = self.scheduler.update(out, tokens)
        now = self.clock()
        deltas: dict[str, tuple[str, int]] = {}
        failed: dict[str, Exception] = {}
        for req in got:
            # A try costs nothing until it catches (zero-cost exceptions, Python 3.11).
            try:
                if req.pooling is not None:
                    self._pooled(req, samples.get(req.request_id), now)
                    deltas[req.request_id] = ("", 0)
                else:
                    deltas[req.request_id] = (self._advance(req, samples, now), 1)
            except Exception as e:  # this request's own work: it alone fails
                failed.setdefault(req.parent_id, e)
        return _Update(got, deltas, failed, now)

    def _pooled(self, req: Request, result: StepResult | None, now: float) -> None:
        """Finish embedding request ``req`` with its vector (finish reason ``stop``; its
        blocks freed, its full blocks left in the prefix cache).

        Raises:
            What its pooling raised in the runner (``req.error``); RuntimeError when the
            runner returned no vector for it.
        """
        if req.error is not None:
            raise req.error
        if not isinstance(result, PooledResult):
            raise RuntimeError(f"the runner returned {type(result).__name__}, not a vector")
        req.embedding = result.embedding
        req.first_token_time = now
        self.scheduler.finish(req, FinishReason.STOP, now)

    def _advance(self, req: Request, samples: dict[str, StepResult], now: float) -> str:
        """Advance ``req`` by its sampled token: its grammar, first-token time, logprobs,
        text and stop check; a request that stops here finishes (its blocks freed, its
        held-back text flushed unless a stop string ended it). Returns its new text.

        Raises:
            What the request's own work raised: in the sampler (``req.error``), in its
            grammar or in its detokenizer.
        """
        if req.error is not None:
            raise req.error
        sample = samples[req.request_id]
        assert isinstance(sample, SampleResult)  # a generating request samples
        if req.grammar is not None:
            req.grammar.accept_token(sample.token_id)
        if req.first_token_time is None:
            req.first_token_time = now
        if sample.logprobs is not None:
            req.logprobs.append(sample.logprobs)
        text, stop_str = req.detokenizer.update(
            [sample.token_id], len(req.output_token_ids) >= req.params.min_tokens
        )
        reason = self._stop_reason(req, sample.token_id, stop_str)
        if reason is not None:
            if stop_str is None:
                text += req.detokenizer.flush()
            self.scheduler.finish(req, reason, now)
        return text

    def _outputs(self, update: _Update) -> list[RequestOutput]:
        """Outputs: for each caller request that got a token, in the step's order, its
        failure's last output (:meth:`_fail`) or the output its kind asks for
        (``make_output``; none yet for ``FINAL_ONLY``); a finished request is forgotten
        (its :class:`FinishRecord` to ``on_finish``). An exception in making an output
        fails that request alone."""
        outputs = []
        for parent in dict.fromkeys(r.parent_id for r in update.got):
            if parent in update.failed:
                outputs.append(self._fail(parent, update.failed[parent], update.now))
                continue
            group = self._groups[parent]
            try:
                output = make_output(group, update.deltas)
            except Exception as e:
                outputs.append(self._fail(parent, e, update.now))
                continue
            if output is not None:
                outputs.append(output)
            if group.finished:
                del self._groups[parent]
                self._finished(group)
        return outputs

    def _record_step(self, step: _Scheduled, tokens_at: float) -> None:
        """Learn the step's duration (:meth:`observe_step`) and hand its
        :class:`StepRecord` to each step listener in turn. ``tokens_at``: when the
        step's tokens were taken, on the engine's clock."""
        out = step.out
        seconds = self.clock() - step.start
        self.observe_step(out.num_batched_tokens - out.num_decodes, out.num_decodes, seconds)
        self._num_steps += 1
        if self.step_listeners:
            record = self._make_record(step, seconds, tokens_at - step.start)
            for listener in self.step_listeners:
                listener(record)

    def _step_failed(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Fail every request of a step whose run raised ``error``; their KV blocks were
        allocated for the step and are freed with them, so the scheduler's queues and the
        block manager stay as if those requests had been aborted.

        Raises:
            EngineBrokenError: this was the :data:`MAX_FAILED_STEPS`-th failed step in a row.
        """
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise EngineBrokenError(
                f"{self._failed_steps} steps in a row failed to run; the last: "
                f"{type(error).__name__}: {error}"
            ) from error
        now = self.clock()
        parents = dict.fromkeys(s.request.parent_id for s in out.seqs)
        return [self._fail(p, error, now) for p in parents if p in self._groups]

    def _fail(self, request_id: str, error: Exception, now: float) -> RequestOutput:
        """End request ``request_id`` (all its sequences) with finish reason ``error``,
        free its blocks, and make its last output, which carries the error."""
        message = f"{type(error).__name__}: {error}"
        logger.error("request %s failed: %s", request_id, message, exc_info=error)
        group = self._groups.pop(request_id)
        for req in group.seqs:
            if not req.is_finished:
                self.scheduler.finish(req, FinishReason.ERROR, now)
        self._finished(group)
        first = group.seqs[0]
        return RequestOutput(
            request_id=request_id,
            prompt=group.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[
                CompletionOutput(index=r.index, text="", token_ids=[], finish_reason="error")
                for r in group.seqs
            ],
            finished=True,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=group.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=first.first_token_time,
                finish_time=now,
            ),
            error=message,
        )

    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call ``listener`` with every step's :class:`StepRecord`, after the listeners
        added before it (see :attr:`step_listeners`)."""
        self.step_listeners.append(listener)

    def observe_step(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """Learn from one step that ran (its prefill tokens, decodes and seconds): the
        step-time model that admission and the TPOT guard read, and the recent step
        times of the load snapshot. Every step calls it; a replay of a server's step log
        calls it for the steps the server ran before the replayed ones.

        Raises:
            ValueError: a negative or non-finite value.
        """
        self.step_time_model.observe(prefill_tokens, decodes, seconds)
        self._recent_step_s.append(seconds)

    def _finished(self, group: RequestGroup) -> None:
        if self.on_finish is None:
            return
        first = group.seqs[0]
        tokens = [r.first_token_time for r in group.seqs if r.first_token_time is not None]
        self.on_finish(
            FinishRecord(
                request_id=group.request_id,
                traffic_class=first.traffic_class,
                priority=first.priority,
                prompt_tokens=len(first.prompt_token_ids),
                max_tokens=first.max_tokens,
                output_tokens=max(len(r.output_token_ids) for r in group.seqs),
                arrival=group.arrival_time,
                first_token=min(tokens) if tokens else None,
                finish=max(r.finish_time or group.arrival_time for r in group.seqs),
                reason=str(first.finish_reason or "abort"),
            )
        )

    def _predict(self, out: SchedulerOutput) -> float:
        model = self.step_time_model
        prefill = out.num_batched_tokens - out.num_decodes
        return model.predict(prefill, out.num_decodes) * model.local_ratio()

    def _make_record(self, step: _Scheduled, seconds: float, tokens_at: float) -> StepRecord:
        out, sched, plan = step.out, self.scheduler, self.scheduler.last_guard
        return StepRecord(
            index=self._num_steps - 1,
            start=step.start,
            seconds=seconds,
            schedule_s=step.schedule_s,
            tokens_at=tokens_at,
            phases=tuple(getattr(self.runner, "last_phases", ())),
            predicted_s=step.predicted_s,
            num_decodes=out.num_decodes,
            num_prefill_tokens=out.num_batched_tokens - out.num_decodes,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            seqs=tuple((s.request.request_id, s.start, s.num_tokens) for s in out.seqs),
            preempted=tuple(r.request_id for r in out.preempted),
            prefill_cap=plan.cap,
            owed_cap=plan.owed,
            sat_out=tuple(sorted(plan.deferred)),
            shed=tuple(r.request_id for r in plan.shed),
        )

    def load_snapshot(self, in_flight: SchedulerOutput | None = None) -> LoadSnapshot:
        """This replica's load, per traffic class, for admission control and routing.

        ``in_flight``: a step scheduled and not run yet; the snapshot is then as after it
        (its prefill chunks done) and ``step_left_s`` is its predicted duration.
        """
        chunks = {} if in_flight is None else {s.request.request_id: s for s in in_flight.seqs}
        waiting_tokens: dict[str, int] = {}
        waiting: dict[str, int] = {}
        running: dict[str, int] = {}
        blocks: dict[str, int] = {}
        bm = self.block_manager
        for req in self.scheduler.waiting:
            c = req.traffic_class
            cached = len(self.scheduler.cached_prefix(req)) * bm.block_size
            waiting_tokens[c] = waiting_tokens.get(c, 0) + req.num_pending_tokens - cached
            waiting[c] = waiting.get(c, 0) + 1
        for req in self.scheduler.running:
            c = req.traffic_class
            running[c] = running.get(c, 0) + 1
            chunk = chunks.get(req.request_id)
            left = (
                req.num_pending_tokens
                if chunk is None
                else (0 if chunk.samples else req.num_pending_tokens - chunk.num_tokens)
            )
            if left > 1 or (chunk is not None and left > 0):  # still prefilling
                waiting_tokens[c] = waiting_tokens.get(c, 0) + left
            blocks[c] = blocks.get(c, 0) + len(bm.block_table(req.request_id))
        return LoadSnapshot(
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            num_kv_blocks_free=bm.num_free_blocks,
            block_size=bm.block_size,
            waiting_prefill_tokens=waiting_tokens,
            running_seqs=running,
            waiting_requests=waiting,
            kv_blocks_used=blocks,
            kv_usage=bm.usage,
            prefix_cache_hit_rate=bm.hit_rate,
            num_cached_blocks=bm.num_cached_blocks,
            step_coefficients=self.step_time_model.coefficients(),
            step_fit_warm=self.step_time_model.warm,
            tpot_slo_guard=self.config.tpot_slo_guard,
            tpot_slo_guard_target=self.config.tpot_slo_guard_target,
            owed_step_s=self._owed_step_s(),
            recent_step_s=(
                statistics.fmean(self._recent_step_s)
                if self._recent_step_s and self.has_unfinished_requests()
                else 0.0
            ),
            step_left_s=0.0 if in_flight is None else self._predict(in_flight),
            timestamp=time.time(),
            loras=tuple(self.list_loras()),
            lora_load_s=getattr(getattr(self.runner, "lora", None), "mean_load_s", 0.0),
        )

    def _owed_step_s(self) -> float:
        """``LoadSnapshot.owed_step_s``: the last plan's lent limit while requests run."""
        lent = self.scheduler.last_guard.lent_s
        return lent if self.scheduler.running and math.isfinite(lent) else 0.0

    def _stop_reason(self, req: Request, token: int, stop_str: str | None) -> FinishReason | None:
        params = req.params
        if stop_str is not None:
            req.stop_reason = stop_str
            return FinishReason.STOP
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if len(req.output_token_ids) >= req.max_tokens:
            return FinishReason.LENGTH
        return None
