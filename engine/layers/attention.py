"""Paged attention registered with transformers' ``AttentionInterface``.

The decoder layers (:class:`engine.layers.fused.FusedAttention`) compute q/k/v and RoPE and
call :func:`paged_attention` once per layer with a flattened varlen batch (batch dimension 1,
``T`` tokens); it keeps transformers' attention-interface signature. The
function writes the new K/V into the paged cache through the slot mapping, then attends
each query to its sequence's cached context. The step's metadata arrives as the keyword
argument ``attn_metadata``, passed to the model's forward: no global state.

Backends (chosen by :mod:`engine.model.attention_backend`):
* flash-attn (``block_size`` a multiple of 256): ``flash_attn_varlen_func`` with a block
  table reads the paged cache in place (Dao, FlashAttention-2, 2023). The function comes
  with the metadata, so a test can run this path on CPU with a reference implementation.
* PyTorch SDPA otherwise: decodes are batched into padded SDPA calls, one per group of
  similar context lengths (:func:`decode_groups`); each prefill chunk is one SDPA call. On
  CPU SDPA runs PyTorch's flash-attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class FlashAttnVarlenFunc(Protocol):
    """``flash_attn.flash_attn_varlen_func`` as the engine calls it, on a paged cache.

    Args:
        q: ``[total_q, H, D]``, the step's queries, sequence after sequence.
        k, v: ``[num_blocks, block_size, KVH, D]``, the paged cache (``H % KVH == 0``).
        cu_seqlens_q: ``[B + 1]`` int32, offsets of each sequence's queries in ``q``.
        cu_seqlens_k: ``[B + 1]`` int32, running sums of each sequence's key count (its
            whole context, this step's tokens included).
        max_seqlen_q, max_seqlen_k: the longest query run and context of the batch.
        softmax_scale: multiplies ``q @ k.T`` before the softmax.
        causal: a query attends to keys up to its own position, the mask aligned to the
            bottom right (the last query of a sequence sees its whole context).
        block_table: ``[B, max_blocks]`` int32, each sequence's cache blocks in order.

    Returns:
        ``[total_q, H, D]``.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float | None,
        causal: bool,
        block_table: torch.Tensor,
    ) -> torch.Tensor: ...


ATTN_IMPLEMENTATION = "iterserve_paged"
DECODE_SPLIT_SLOTS = 512
"""Padded context slots that one more decode SDPA call per layer must save to be worth it.

A padded slot costs a gather and an attention read of its K and V in every layer; one more
gather and SDPA call per layer costs a fixed dispatch in every layer. The balance was
estimated, not swept: ``bench/results/experiments/decode_attention.json`` times decode
steps with the groups against one padded call."""


@dataclass(slots=True)
class PrefillChunk:
    """One prefill chunk for the SDPA backend.

    ``context_slots`` (``[context_len]`` int64) addresses the sequence's whole context in
    the flattened cache; ``mask`` (``[chunk_len, context_len]`` bool) is the causal mask
    offset by the tokens already cached, or None for a first chunk (plain causal).
    """

    start: int
    end: int
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Decodes ``[start, end)`` of the step, attended in one padded SDPA call.

    ``slots`` (``[end - start, max_context]`` int64) addresses each decode's context in
    the flattened cache, padded to the group's longest; ``mask``
    (``[end - start, 1, 1, max_context]`` bool, True = attend) hides the padding.
    """

    start: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor


def decode_groups(context_lens: list[int]) -> list[tuple[int, int]]:
    """Split decodes, sorted by context length (longest first), into ``[start, end)`` groups
    that each get one padded SDPA call.

    A group's call pads every member to its first (longest) context. A new group starts at
    decode ``i`` when padding ``i`` and every shorter decode after it to the current
    group's length would waste more than :data:`DECODE_SPLIT_SLOTS` slots: one long
    context then no longer makes every short decode pay for its length.

    Raises:
        ValueError: ``context_lens`` is not sorted longest first.
    """
    if any(a < b for a, b in zip(context_lens, context_lens[1:])):
        raise ValueError("context_lens must be sorted longest first")
    groups, start, n = [], 0, len(context_lens)
    for i in range(1, n):
        if (context_lens[start] - context_lens[i]) * (n - i) > DECODE_SPLIT_SLOTS:
            groups.append((start, i))
            start = i
    if n:
        groups.append((start, n))
    return groups


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers.

    Shapes (``T`` tokens in the step, ``B`` sequences; decodes first, ordered longest
    context first):
        slot_mapping: ``[T]`` int64, flat cache slot of each token
            (``block_table[pos // block_size] * block_size + pos % block_size``).
        query_start_loc: ``[B + 1]`` int32, offsets of each sequence's tokens.
        context_lens: ``[B]`` int32, tokens in each sequence's context after this step.
        block_tables: ``[B, max_blocks]`` int32, padded with 0.
        flash_attn: the flash-attn backend's function, or None for SDPA and the CPU kernels.
        cu_seqlens_k: ``[B + 1]`` int32, running sums of ``context_lens`` (flash-attn only).
        decode_groups: the decodes' padded SDPA calls (SDPA backend; :class:`DecodeGroup`).
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_context_len: int
    num_decodes: int
    flash_attn: FlashAttnVarlenFunc | None = None
    cu_seqlens_k: torch.Tensor | None = None
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged KV cache for a flattened varlen batch.

    Args:
        module: the attention layer; its ``layer_idx`` selects the cache.
        query: ``[1, H, T, D]``.
        key, value: ``[1, KVH, T, D]`` for this step's tokens (RoPE applied, GQA not expanded).
        attention_mask: unused (None): masking comes from ``attn_metadata``.
        scaling: softmax scale.
        attn_metadata: the step's :class:`AttentionMetadata`.

    Returns:
        ``([1, T, H, D], None)``.

    Raises:
        ValueError: called without ``attn_metadata`` (e.g. outside the engine).
    """
    md = attn_metadata
    if md is None:
        raise ValueError("paged_attention needs attn_metadata; run the model through the engine")
    k_cache, v_cache = md.kv_caches[module.layer_idx]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    k_new = key[0].transpose(0, 1)  # [T, KVH, D]
    v_new = value[0].transpose(0, 1)
    # A cache of another dtype (kv_cache_dtype) stores the values rounded to it.
    k_flat.index_copy_(0, md.slot_mapping, k_new.to(k_flat.dtype))
    v_flat.index_copy_(0, md.slot_mapping, v_new.to(v_flat.dtype))
    q = query[0].transpose(0, 1)  # [T, H, D]

    if md.flash_attn is not None:
        out = md.flash_attn(
            q.contiguous(),
            k_cache,
            v_cache,
            cu_seqlens_q=md.query_start_loc,
            cu_seqlens_k=md.cu_seqlens_k,
            max_seqlen_q=md.max_query_len,
            max_seqlen_k=md.max_context_len,
            softmax_scale=scaling,
            causal=True,
            block_table=md.block_tables,
        )
        return out.unsqueeze(0), None

    out = torch.empty_like(q)
    _attend_decodes(md, q, k_flat, v_flat, scaling, out)
    attend_prefills(md, q, k_new, v_new, k_flat, v_flat, scaling, out)
    return out.unsqueeze(0), None


def _attend_decodes(
    md: AttentionMetadata,
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """Decode rows of ``out`` (``[T, H, D]``): one padded SDPA call per decode group, each
    ``[n, H, 1, D]`` against its gathered ``[n, KVH, L, D]`` context."""
    for g in md.decode_groups:
        # index_select on flat slots is much faster than advanced indexing on CPU.
        shape = (*g.slots.shape, *k_flat.shape[1:])
        flat_slots = g.slots.view(-1)
        kd = k_flat.index_select(0, flat_slots).to(q.dtype).view(shape).transpose(1, 2)
        vd = v_flat.index_select(0, flat_slots).to(q.dtype).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[g.start : g.end].unsqueeze(2),
            kd,
            vd,
            attn_mask=g.mask,
            scale=scaling,
            enable_gqa=True,
        )
        out[g.start : g.end] = o.squeeze(2)


def attend_prefills(
    md: AttentionMetadata,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """Prefill rows of ``out``: one SDPA call per chunk, against the chunk's own K/V for a
    first chunk (plain causal), else its whole cached context with the offset mask.

    Shapes: ``q`` and ``out`` ``[T, H, D]``; ``k_new``, ``v_new`` ``[T, KVH, D]`` (this
    step's tokens, already written to the cache); ``k_flat``, ``v_flat``
    ``[num_slots, KVH, D]``. Used by :func:`paged_attention` and
    :class:`engine.cpu.kernel_layers.KernelDecoderLayer`."""
    for p in md.prefills:
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if p.context_slots is None:
            kp, vp = k_new[p.start : p.end], v_new[p.start : p.end]
        else:
            kp = k_flat.index_select(0, p.context_slots).to(q.dtype)
            vp = v_flat.index_select(0, p.context_slots).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scaling,
            enable_gqa=True,
        )
        out[p.start : p.end] = o[0].transpose(0, 1)
