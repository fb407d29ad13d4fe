"""LLMEngine: add requests, step the batching loop, collect incremental outputs."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine.attention import ATTN_IMPLEMENTATION
from engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import BlockManager
from engine.model_loader import load_model
from engine.request import (
    CompletionOutput,
    FinishReason,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from engine.runner import ModelRunner, kv_bytes_per_token
from engine.scheduler import Scheduler
from policies import DEFAULT_CLASS, LoadSnapshot, StepTimeModel, make_classes, make_policy

RECENT_STEPS = 8
"""Steps averaged into ``LoadSnapshot.recent_step_s`` (a few, so it follows bursts)."""

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict


class RequestRejectedError(ValueError):
    """A request can never run here: too long for the context or for the whole KV cache.

    ``num_tokens`` is what the request needs (prompt plus max_tokens) and ``limit`` the
    most it may use, both in tokens.
    """

    def __init__(self, message: str, num_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.limit = limit


@dataclass(slots=True)
class _Group:
    """The ``n`` sequences of one caller request."""

    request_id: str
    prompt: str | None
    seqs: list[Request]
    arrival_time: float


class LLMEngine:
    """One replica's engine: scheduler, KV block manager, model runner, detokenizer.

    Not thread-safe: one caller drives ``add_request``/``step``/``abort``
    (``AsyncLLMEngine`` serialises them onto its loop).
    """

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        device, dtype = config.torch_device(), config.torch_dtype()
        model, self.tokenizer, self.model_dir = load_model(
            config.model, dtype, device, ATTN_IMPLEMENTATION, config.cpu_weight_prepack
        )
        hf_config = model.config
        context = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            # The paged attention attends to the whole context; capping the context at the
            # window keeps it exact for sliding-window models (Mistral).
            context = min(context, window)
        self.max_model_len = min(config.max_model_len or context, context)
        self.vocab_size = hf_config.vocab_size
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
            num_blocks = budget // (config.block_size * kv_bytes_per_token(hf_config, dtype))
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block")
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.traffic_classes = make_classes(config.traffic_classes)
        policy = make_policy(config.policy, **config.policy_options())
        self.step_time_model = StepTimeModel()
        self._recent_step_s: deque[float] = deque(maxlen=RECENT_STEPS)
        self.scheduler = Scheduler(config, self.block_manager, policy, clock,
                                   self.step_time_model if config.tpot_slo_guard else None)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device, dtype, config.seed)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self._groups: dict[str, _Group] = {}
        self.last_step_num_tokens = 0
        """Tokens the last ``step()`` ran (0: it had nothing to schedule)."""
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d, %s",
            self.model_dir, num_blocks, config.block_size, self.max_model_len, device,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

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
        sampling_params: SamplingParams | None = None,
        priority: int | None = None,
        traffic_class: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next step that has room.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": str}``.
            sampling_params: default ``SamplingParams()``.
            priority: lower is more urgent; None: the traffic class's default priority.
            traffic_class: a configured class (default ``standard``).
            arrival_time: seconds on the engine's clock; default now.

        Raises:
            ValueError: duplicate id, empty prompt or unknown traffic class.
            RequestRejectedError: prompt plus max_tokens exceeds the model's context or the
                whole KV cache, so it could never run.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        traffic_class = traffic_class or DEFAULT_CLASS
        if traffic_class not in self.traffic_classes:
            raise ValueError(
                f"unknown traffic_class {traffic_class!r}; known: {sorted(self.traffic_classes)}"
            )
        if priority is None:
            priority = self.traffic_classes[traffic_class].default_priority
        text, ids = self.tokenize(prompt)
        max_tokens = self.check_length(len(ids), params.max_tokens)
        now = self.clock() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            cls = self.traffic_classes[traffic_class]
            req = Request(seq_id, ids, params, now, max_tokens, priority=priority,
                          traffic_class=traffic_class, parent_id=request_id, index=i,
                          ttft_slo_s=cls.ttft_slo_s, tpot_slo_s=cls.tpot_slo_s)
            if params.seed is not None and params.n > 1:
                req.params = replace(params, seed=params.seed + i)
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
            seqs.append(req)
        self._groups[request_id] = _Group(request_id, text, seqs, now)
        for req in seqs:
            self.scheduler.add(req)

    def check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        """Return the effective max_tokens (None: up to the context or KV capacity).

        Raises:
            RequestRejectedError: prompt plus max_tokens exceeds the context or the KV cache.
        """
        limit = min(self.max_model_len, self.kv_capacity_tokens)
        if max_tokens is None:
            max_tokens = limit - prompt_len
            if max_tokens < 1:
                raise RequestRejectedError(
                    f"prompt has {prompt_len} tokens; the limit is {limit - 1} "
                    f"(max_model_len {self.max_model_len}, "
                    f"KV cache {self.kv_capacity_tokens} tokens)",
                    prompt_len + 1, limit,
                )
        need = prompt_len + max_tokens
        if need > self.max_model_len:
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) = {need} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens",
                need, self.max_model_len,
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and need > budget:
            # Without chunking a prompt (and, after preemption, its recompute) must fit
            # one step's budget whole, or it would wait forever.
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) = {need} tokens "
                f"exceeds max_num_batched_tokens ({budget}) with chunked prefill disabled",
                need, budget,
            )
        if need > self.kv_capacity_tokens:
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) = {need} tokens "
                f"exceeds the KV cache capacity of {self.kv_capacity_tokens} tokens",
                need, self.kv_capacity_tokens,
            )
        return max_tokens

    def abort(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Finish requests with reason ``abort`` and free their KV blocks at once.

        Unknown or finished ids are ignored. Returns the aborted requests' final outputs.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        now = self.clock()
        outs = []
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for req in group.seqs:
                if not req.is_finished:
                    self.scheduler.finish(req, FinishReason.ABORT, now)
            outs.append(self._output(group, {}))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one iteration.

        Returns:
            One output for each request that got a token (cumulative text and tokens, plus
            this step's delta); finished requests appear once with ``finished=True``.
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()
        self.last_step_num_tokens = out.num_batched_tokens
        if out.is_empty:
            return []
        samples = self.runner.execute(out)
        got = self.scheduler.update(out, {rid: s.token_id for rid, s in samples.items()})
        now = self.clock()
        deltas: dict[str, tuple[str, list[int]]] = {}
        for req in got:
            sample = samples[req.request_id]
            token = sample.token_id
            if req.first_token_time is None:
                req.first_token_time = now
            if sample.logprobs is not None:
                req.logprobs.append(sample.logprobs)
            text, stop_str = req.detokenizer.update([token])
            reason = self._stop_reason(req, token, stop_str)
            if reason is not None:
                if stop_str is None:
                    text += req.detokenizer.flush()
                self.scheduler.finish(req, reason, now)
            deltas[req.request_id] = (text, [token])
        outputs = []
        for parent in dict.fromkeys(r.parent_id for r in got):
            group = self._groups[parent]
            outputs.append(self._output(group, deltas))
            if all(r.is_finished for r in group.seqs):
                del self._groups[parent]
        seconds = time.perf_counter() - start
        self.step_time_model.observe(out.num_batched_tokens - out.num_decodes,
                                     out.num_decodes, seconds)
        self._recent_step_s.append(seconds)
        return outputs

    def load_snapshot(self) -> LoadSnapshot:
        """This replica's load, per traffic class, for admission control and routing."""
        waiting_tokens: dict[str, int] = {}
        waiting: dict[str, int] = {}
        running: dict[str, int] = {}
        blocks: dict[str, int] = {}
        for req in self.scheduler.waiting:
            c = req.traffic_class
            waiting_tokens[c] = waiting_tokens.get(c, 0) + req.num_pending_tokens
            waiting[c] = waiting.get(c, 0) + 1
        for req in self.scheduler.running:
            c = req.traffic_class
            running[c] = running.get(c, 0) + 1
            if req.num_pending_tokens > 1:  # still prefilling
                waiting_tokens[c] = waiting_tokens.get(c, 0) + req.num_pending_tokens
            blocks[c] = blocks.get(c, 0) + len(self.block_manager.block_table(req.request_id))
        bm = self.block_manager
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
            step_coefficients=self.step_time_model.coefficients(),
            tpot_slo_guard=self.config.tpot_slo_guard,
            tpot_slo_guard_target=self.config.tpot_slo_guard_target,
            recent_step_s=(statistics.fmean(self._recent_step_s)
                           if self._recent_step_s and self.has_unfinished_requests() else 0.0),
            timestamp=time.time(),
        )

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

    def _output(self, group: _Group, deltas: dict[str, tuple[str, list[int]]]) -> RequestOutput:
        completions = []
        for req in group.seqs:
            delta_text, delta_ids = deltas.get(req.request_id, ("", []))
            completions.append(CompletionOutput(
                index=req.index,
                text=req.detokenizer.text,
                token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                stop_reason=req.stop_reason,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            ))
        firsts = [r.first_token_time for r in group.seqs if r.first_token_time is not None]
        finished = all(r.status is RequestStatus.FINISHED for r in group.seqs)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.seqs[0].prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=group.arrival_time,
                first_token_time=min(firsts) if firsts else None,
                finish_time=max(r.finish_time for r in group.seqs) if finished else None,
            ),
        )
