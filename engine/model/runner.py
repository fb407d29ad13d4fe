"""Model runner: turns a scheduled step into one varlen forward pass and samples it."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from engine.core.interfaces import PooledResult, StepResult
from engine.core.request import Request
from engine.core.schedule_output import ScheduledSeq, SchedulerOutput
from engine.cpu.kernel_layers import KernelDecoderLayer
from engine.layers.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    decode_groups,
    paged_attention,
)
from engine.lora import LoRAManager
from engine.model.attention_backend import (
    AttentionBackend,
    FlashAttnVarlenFunc,
    select_attention_backend,
)
from engine.model.loader import WeightInfo, load_model
from engine.model.sampler import Sampler, prompt_logprob_rows, record_prompt_logprobs

logger = logging.getLogger(__name__)

AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


@dataclass(slots=True)
class PoolSpan:
    """An embedding request's chunk in a step: rows ``[row_start, row_end)`` of the
    step's flattened tokens, from its prompt position ``start``; ``last``: the chunk
    ends its prompt."""

    request: Request
    row_start: int
    row_end: int
    start: int
    last: bool


def model_context(hf_config, max_model_len: int | None = None) -> int:
    """Tokens of context the engine serves: the model's, capped by ``max_model_len``.

    The paged attention attends to the whole context; capping the context at a
    sliding-window model's window (Mistral) keeps it exact.
    """
    context = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        context = min(context, window)
    return min(max_model_len or context, context)


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    per_layer = 2 * hf_config.num_key_value_heads * head_dim
    return hf_config.num_hidden_layers * per_layer * torch.tensor([], dtype=dtype).element_size()


class TorchModelRunner:
    """Owns the model, the KV cache tensors and the sampler (the engine's
    :class:`engine.core.interfaces.ModelRunner`).

    The KV cache is one ``(k, v)`` pair per layer, each ``[num_blocks, block_size, KVH, D]``.

    ``attention`` is the backend (:func:`engine.model.attention_backend.select_attention_backend`;
    :meth:`load` resolves it before it loads the model, whose decoder layers are then
    :class:`KernelDecoderLayer` exactly when it is ``cpu_kernels``). Every branch here runs
    on CPU, the flash-attn one with an injected ``flash_attn_varlen_func``; on CUDA only
    the device of the step's tensors differs, and the forward's time (``last_phases``)
    counts launches, not kernels.

    Raises:
        ValueError: ``attention`` disagrees with the model's layers (kernel layers without
            the ``cpu_kernels`` backend, or that backend without them).
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        seed: int,
        max_model_len: int | None = None,
        *,
        attention: AttentionBackend,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        embedding_pooling: Literal["last", "mean"] = "last",
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_kv_blocks = num_blocks
        self.max_model_len = model_context(cfg, max_model_len)
        self.vocab_size = cfg.vocab_size
        self.hidden_size: int = cfg.hidden_size
        """The length of an embedding request's full vector."""
        self.embedding_pooling = embedding_pooling
        """How an embedding request's final hidden states become one vector (``last``
        or ``mean``; :class:`engine.core.params.PoolingParams`)."""
        self._pool_sums: dict[str, tuple[Request, torch.Tensor]] = {}
        """``mean`` pooling: the fp32 sum of the final hidden states of each embedding
        request's prompt chunks so far, by request id, with the request (an aborted
        one's sum is dropped at the next step)."""
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos]) - {None}
        kernel_layers = [m for m in model.modules() if isinstance(m, KernelDecoderLayer)]
        if (attention.name == "cpu_kernels") != bool(kernel_layers):
            raise ValueError(
                f"attention backend {attention.name!r} with "
                f"{'kernel' if kernel_layers else 'transformers'} decoder layers"
            )
        self.attention = attention
        """The attention backend (:class:`engine.model.attention_backend.AttentionBackend`)."""
        self.kernel_decode = bool(kernel_layers)
        """Decodes are attended by :mod:`engine.cpu.kernels` (no SDPA decode groups)."""
        self.kernel_prefill = self.kernel_decode and all(m.prefill_kernel for m in kernel_layers)
        """Prefill chunks too (no SDPA gather indices or masks)."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (num_blocks, block_size, cfg.num_key_value_heads, head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=kv_dtype, device=device),
                torch.zeros(shape, dtype=kv_dtype, device=device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler(device, seed)
        self.decode_stack = None
        """Runs decode-only steps of a packed model in one C call
        (:class:`engine.quant.decode_stack.DecodeStack`), where it applies."""
        if self.kernel_decode:
            from engine.quant import kernels as quant_kernels
            from engine.quant.decode_stack import DecodeStack

            quant = quant_kernels.load()
            if quant is not None:
                self.decode_stack = DecodeStack.build(
                    model, self.kv_caches, attention.cpu_kernels, quant
                )
        self.lora: LoRAManager | None = None
        """The replica's LoRA adapters (None: its decoder layers are not fused, and it
        serves none). Made after the decode stack, which reads the bare projections and
        runs only steps without adapters."""
        try:
            self.lora = LoRAManager(model, max_loras, max_lora_rank, max_cpu_loras or max_loras)
        except ValueError as e:
            logger.info("no LoRA adapters: %s", e)
        self.weights: WeightInfo | None = None
        """How the model holds its weights (set by :meth:`load`)."""
        self.last_phases: tuple[tuple[str, float], ...] = ()
        """Seconds (``time.perf_counter``) the last :meth:`execute` spent in each part:
        ``(("prepare", s), ("forward", s), ("sample", s))``; the engine's ``StepRecord.phases``.
        On CUDA the forward is asynchronous: its time is the launches', and the sampler's
        includes waiting for the logits."""

    @property
    def use_flash(self) -> bool:
        """The step attends through flash-attn's ``flash_attn_varlen_func``."""
        return self.attention.name == "flash_attn"

    @classmethod
    def load(
        cls, config: EngineConfig, flash_attn_varlen_func: FlashAttnVarlenFunc | None = None
    ) -> tuple[TorchModelRunner, Any, str]:
        """Load ``config.model`` and size its KV cache: ``(runner, tokenizer, model dir)``.

        The cache holds ``config.num_kv_blocks`` blocks, else as many as
        ``config.kv_cache_memory_bytes`` (default 1 GiB) holds. The attention backend is
        ``config.attention_backend``; ``flash_attn_varlen_func`` replaces flash-attn's own
        function (see :func:`engine.model.attention_backend.select_attention_backend`).

        Raises:
            ModelLoadError: missing model or unsupported architecture.
            ValueError: the memory budget holds no KV block, or the attention backend
                cannot run here.
        """
        device, dtype = config.torch_device(), config.torch_dtype()
        kv_dtype = config.torch_kv_dtype()
        attention = select_attention_backend(
            config.attention_backend, device, dtype, config.block_size, flash_attn_varlen_func
        )
        if attention.name == "flash_attn" and kv_dtype != dtype:
            raise ValueError(
                f"attention_backend flash_attn reads the cache in the model dtype ({dtype}): "
                f"kv_cache_dtype {config.kv_cache_dtype} needs another backend"
            )
        loaded = load_model(
            config.model,
            dtype,
            device,
            ATTN_IMPLEMENTATION,
            config.cpu_weight_prepack,
            cpu_kernels=attention.cpu_kernels,
            quantization=config.quantization,
        )
        model, tokenizer, model_dir = loaded.model, loaded.tokenizer, loaded.model_dir
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
            per_token = kv_bytes_per_token(model.config, kv_dtype)
            num_blocks = budget // (config.block_size * per_token)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block")
        runner = cls(
            model,
            num_blocks,
            config.block_size,
            device,
            kv_dtype,
            config.seed,
            config.max_model_len,
            attention=attention,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
            embedding_pooling=config.embedding_pooling,
        )
        runner.weights = loaded.weights
        if not runner.eos_token_ids and tokenizer.eos_token_id is not None:
            runner.eos_token_ids = frozenset([tokenizer.eos_token_id])
        return runner, tokenizer, model_dir

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, StepResult]:
        """Run one step: forward over all scheduled tokens, sample where chunks end, and
        pool the final hidden states of embedding requests' chunks.

        Returns:
            The sampled token (and log-probabilities) of each request whose chunk
            reached its last token; an embedding request's vector
            (:class:`engine.core.interfaces.PooledResult`) instead.
        """
        t0 = time.perf_counter()
        input_ids, positions, md, keep_idx, sampling_reqs, spans, pools = self._prepare(out)
        t1 = time.perf_counter()
        adapters = self.lora is not None and self.lora.step.onehot is not None
        # The final norm's output: the hidden states an embedding pools. Hooked only for a
        # step that pools, so other steps pay nothing.
        final: list[torch.Tensor] = []
        hook = (
            self.model.model.norm.register_forward_hook(lambda m, a, o: final.append(o))
            if pools
            else None
        )
        try:
            # A step that pools runs the model's own forward, whose final norm sees every
            # row: the decode stack's contract is the kept rows' logits, nothing more.
            if (
                self.decode_stack is not None
                and out.num_decodes == len(out.seqs)
                and not adapters
                and not pools
            ):
                logits = self.decode_stack(input_ids, positions, md, keep_idx)
            else:
                logits = self.model(
                    input_ids=input_ids.unsqueeze(0),
                    position_ids=positions.unsqueeze(0),
                    use_cache=False,
                    logits_to_keep=keep_idx,
                    attn_metadata=md,
                ).logits[0]
        finally:
            if adapters:
                self.lora.finish()
            if hook is not None:
                hook.remove()
        t2 = time.perf_counter()
        ns = len(sampling_reqs)
        if spans:
            record_prompt_logprobs(logits[ns:], spans)
        results = (
            self.sampler.sample(logits[:ns], sampling_reqs, self.eos_token_ids)
            if sampling_reqs
            else []
        )
        step: dict[str, StepResult] = {r.request_id: s for r, s in zip(sampling_reqs, results)}
        if pools:
            step.update(self._pool(final[-1].reshape(-1, self.hidden_size), pools))
        t3 = time.perf_counter()
        self.last_phases = (("prepare", t1 - t0), ("forward", t2 - t1), ("sample", t3 - t2))
        return step

    def _pool(self, hidden: torch.Tensor, pools: list[PoolSpan]) -> dict[str, PooledResult]:
        """The vector of each embedding request whose prompt ends in this step, from the
        step's final hidden states ``[T, hidden]``; ``mean`` pooling adds each chunk's
        rows to the request's sum first, so a prompt chunked over steps pools as one.
        A sum that is missing (it cannot be: a ``mean`` request takes no prefix-cache
        hit, and starts over at position 0 after a preemption) fails its request alone
        (``req.error``)."""
        for rid in [rid for rid, (r, _) in self._pool_sums.items() if r.is_finished]:
            del self._pool_sums[rid]  # aborted or failed mid-prompt
        done: dict[str, torch.Tensor] = {}
        for p in pools:
            req, rows = p.request, hidden[p.row_start : p.row_end]
            if self.embedding_pooling == "mean":
                total = rows.float().sum(0)
                if p.start > 0:
                    kept = self._pool_sums.pop(req.request_id, None)
                    if kept is None:
                        req.error = RuntimeError(
                            f"mean pooling: the hidden states of positions 0-{p.start - 1} "
                            "were not computed"
                        )
                        continue
                    total = kept[1] + total
                if not p.last:
                    self._pool_sums[req.request_id] = (req, total)
                    continue
                vector = total / req.num_tokens
            else:
                vector = rows[-1].float()
            dims = req.pooling.dimensions
            done[req.request_id] = F.normalize(vector[:dims] if dims else vector, dim=0)
        if not done:
            return {}
        # One copy to the host for the step's vectors (on CUDA, one wait for the device).
        flat = torch.cat(list(done.values())).tolist()
        ends = itertools.accumulate(len(v) for v in done.values())
        return {
            rid: PooledResult(flat[end - len(v) : end]) for (rid, v), end in zip(done.items(), ends)
        }

    def _prepare(self, out: SchedulerOutput):
        """Flatten the step into varlen tensors (shapes in :class:`AttentionMetadata`).

        Decodes go longest context first, so that SDPA's decode groups are contiguous."""
        bs = self.block_size
        nd = out.num_decodes
        seqs = sorted(out.seqs[:nd], key=lambda s: -s.start) + out.seqs[nd:]
        ids: list[int] = []
        pos: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        tables: list[list[int]] = []
        sample_idx: list[int] = []
        sampling_reqs: list[Request] = []
        pools: list[PoolSpan] = []
        bm_tables = out.block_tables
        for seq in seqs:
            req, start, n = seq.request, seq.start, seq.num_tokens
            ids.extend(req.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            qsl.append(qsl[-1] + n)
            ctx.append(start + n)
            tables.append(bm_tables[req.request_id])
            if req.pooling is not None:
                # Only the last chunk matters to `last` pooling; `mean` sums every chunk.
                if seq.samples or self.embedding_pooling == "mean":
                    pools.append(PoolSpan(req, qsl[-2], qsl[-1], start, seq.samples))
            elif seq.samples:
                sample_idx.append(qsl[-1] - 1)
                sampling_reqs.append(req)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
        )
        positions = torch.tensor(pos, dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(ctx)), torch.tensor([s.num_tokens for s in seqs])
        )
        slot_mapping = (
            block_tables[seq_of_token, positions // bs].to(torch.int64) * bs + positions % bs
        )
        if self.lora is not None:
            self.lora.prepare([s.request.lora for s in seqs], seq_of_token)
        context_lens = torch.tensor(ctx, dtype=torch.int32)
        flash = self.attention.flash_attn_varlen_func
        md = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            context_lens=context_lens.to(self.device),
            block_tables=block_tables.to(self.device),
            max_query_len=max(s.num_tokens for s in seqs),
            max_context_len=max(ctx),
            num_decodes=nd,
            flash_attn=flash,
        )
        if flash is not None:
            md.cu_seqlens_k = torch.tensor(
                list(itertools.accumulate(ctx, initial=0)), dtype=torch.int32, device=self.device
            )
        else:
            self._prepare_sdpa(md, seqs, nd, block_tables, ctx, qsl)
        spans, rows = prompt_logprob_rows(seqs, qsl)
        return (
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions.to(self.device),
            md,
            torch.tensor(sample_idx + rows, dtype=torch.int64, device=self.device),
            sampling_reqs,
            spans,
            pools,
        )

    def _prepare_sdpa(
        self,
        md: AttentionMetadata,
        seqs: list[ScheduledSeq],
        nd: int,
        block_tables: torch.Tensor,
        ctx: list[int],
        qsl: list[int],
    ) -> None:
        """Gather indices and masks for the SDPA backend, shared by every layer."""
        bs, dev = self.block_size, self.device
        # Kernel layers attend decodes on the paged cache in place: no gather, no groups.
        for start, end in decode_groups(ctx[:nd]) if not self.kernel_decode else ():
            n, max_ctx = end - start, ctx[start]
            p = torch.arange(max_ctx)
            lens = torch.tensor(ctx[start:end])
            md.decode_groups.append(
                DecodeGroup(
                    start,
                    end,
                    slots=(block_tables[start:end, p // bs].to(torch.int64) * bs + p % bs).to(dev),
                    mask=(p[None, :] < lens[:, None]).view(n, 1, 1, max_ctx).to(dev),
                )
            )
        for i in range(nd, len(seqs)) if not self.kernel_prefill else ():
            seq = seqs[i]
            chunk = PrefillChunk(qsl[i], qsl[i + 1], None, None)
            if seq.start > 0:
                c = seq.start + seq.num_tokens
                p = torch.arange(c)
                chunk.context_slots = (block_tables[i, p // bs].to(torch.int64) * bs + p % bs).to(
                    dev
                )
                q_pos = torch.arange(seq.start, c)
                chunk.mask = (p[None, :] <= q_pos[:, None]).to(dev)
            md.prefills.append(chunk)
