"""LLM: the offline batch API, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from engine.core.request import RequestOutput
from engine.llm_engine import LLMEngine, PromptType

if TYPE_CHECKING:
    from engine.model.attention_backend import FlashAttnVarlenFunc

OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048
"""The offline token budget where none is given. Offline, no step has a TPOT to keep, so
prefills run in larger steps than the server's 512 (``EngineConfig``'s default), which feed
each weight pass more tokens. vLLM does the same by usage context: on CPU its ``LLM`` class
defaults to 4096 and its API server to 2048 (vLLM 0.32, ``EngineArgs.get_batch_defaults``).
The offline prefill rows against vLLM: ``bench/results/peers.md``."""
OFFLINE_MAX_NUM_SEQS = 128
"""Offline running requests per step where none is given, twice the server's 64. Offline
work is many short requests at once; wider decode steps make each weight pass feed more
tokens (``python -m bench.batch throughput``, ``bench/results/batch_throughput.json``).
vLLM's ``run_batch``
defaults to 128 (``SchedulerConfig.DEFAULT_MAX_NUM_SEQS``, vLLM 0.32), its ``LLM`` class on
CPU to 256."""
OFFLINE_DEFAULTS = {
    "max_num_batched_tokens": OFFLINE_MAX_NUM_BATCHED_TOKENS,
    "max_num_seqs": OFFLINE_MAX_NUM_SEQS,
}
"""The :class:`EngineConfig` fields offline work defaults to (``LLM``, ``iterserve batch``)."""


class LLM:
    """Generate completions for a list of prompts with continuous batching.

    ``LLM(model=None, **config)``: ``model`` None means the embedded SmolLM2-135M-Instruct;
    ``config`` holds :class:`EngineConfig` fields (``max_num_seqs``, ``num_kv_blocks``, ...);
    ``max_num_batched_tokens`` and ``max_num_seqs`` default to :data:`OFFLINE_DEFAULTS`.
    ``flash_attn_varlen_func`` replaces flash-attn's own function on the ``flash_attn``
    attention backend (see :func:`engine.model.attention_backend.select_attention_backend`). The
    underlying :class:`LLMEngine` is ``llm.llm_engine``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        flash_attn_varlen_func: FlashAttnVarlenFunc | None = None,
        **config,
    ) -> None:
        config = {**OFFLINE_DEFAULTS, **config}
        self.llm_engine = LLMEngine.from_config(
            EngineConfig(model=model, **config), flash_attn_varlen_func=flash_attn_varlen_func
        )
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        traffic_class: Sequence[str] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Args:
            prompts: one prompt or a list (text, token ids, or ``{"prompt_token_ids": ...}``).
            sampling_params: one for all prompts, or one per prompt.
            priority: one integer per prompt, lower is more urgent (default: the
                traffic class's default priority).
            traffic_class: one class name per prompt (default ``standard``).
            use_tqdm: show a progress bar of finished requests.
            lora_request: the LoRA adapter for all prompts, or one per prompt (None: the
                base model), as vLLM's.

        A request that fails inside the engine (see :meth:`LLMEngine.step`) comes back
        finished, with finish reason ``error`` and its :attr:`RequestOutput.error` set; the
        others run on.

        Raises:
            ValueError: a list argument's length differs from the prompts', or a prompt is
                rejected (see :meth:`LLMEngine.add_request`); nothing runs then.
        """
        prompts = _prompt_list(prompts)
        n = len(prompts)
        given = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * n
        # Only the last output is kept: nothing is copied on the way.
        params = [
            replace(p or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY) for p in given
        ]
        return self._run(prompts, params, priority, use_tqdm, traffic_class, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        traffic_class: Sequence[str] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Embed every prompt (vLLM's ``LLM.embed``): each output, in prompt order, is
        finished with its :attr:`RequestOutput.embedding` (the engine's
        ``embedding_pooling`` of the prompt's final hidden states, L2-normalized; a list
        of ``hidden_size`` floats, or ``dimensions``).

        Arguments as :meth:`generate`'s; ``pooling_params``: one for all prompts, or one
        per prompt (default ``PoolingParams()``).

        Raises:
            ValueError: as :meth:`generate`; ``dimensions`` this model does not serve.
        """
        prompts = _prompt_list(prompts)
        n = len(prompts)
        given = pooling_params if isinstance(pooling_params, Sequence) else [pooling_params] * n
        params = [p or PoolingParams() for p in given]
        return self._run(prompts, params, priority, use_tqdm, traffic_class, lora_request)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams | PoolingParams],
        priority: Sequence[int] | None,
        use_tqdm: bool,
        traffic_class: Sequence[str] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        """Add every prompt with its parameters, then step until all are finished.

        Raises:
            ValueError: see :meth:`generate`.
        """
        n = len(prompts)
        prios = list(priority) if priority is not None else [None] * n
        classes = list(traffic_class) if traffic_class is not None else [None] * n
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * n
        if not len(params) == len(prios) == len(classes) == len(loras) == n:
            raise ValueError(
                f"{n} prompts but {len(params)} parameters, {len(prios)} priorities, "
                f"{len(classes)} traffic classes and {len(loras)} LoRA requests"
            )
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in range(n)]
        try:
            for rid, prompt, p, prio, cls, lora in zip(ids, prompts, params, prios, classes, loras):
                engine.add_request(
                    rid, prompt, p, priority=prio, traffic_class=cls, lora_request=lora
                )
        except Exception:
            engine.abort(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=n, desc="Processed prompts", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """``prompts`` as a list: one prompt (text, token ids or a dict) becomes a list of it."""
    if isinstance(prompts, (str, dict)) or (
        prompts and isinstance(prompts, Sequence) and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)
