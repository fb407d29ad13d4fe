"""Decoder layers whose non-GEMM work runs in :mod:`engine.cpu.kernels` (fp32 on CPU).

A pre-norm Llama-family layer at decode row counts spends about a quarter of its time
outside the four GEMMs, in some 40 small PyTorch ops (norms, residual adds, RoPE, the
q/k/v split, the KV-cache write, the gather and padded SDPA call of decode attention,
SiLU-and-multiply), each with a fixed dispatch cost. :class:`KernelDecoderLayer` runs the
same layer as four GEMMs (the fused projections of :mod:`engine.layers.fused`) and up to
eight kernel calls:

    x = rms_norm(h)                      # kernel (from 32 rows on all threads)
    qkv = qkv_proj(x)                    # GEMM; Qwen3's per-head q/k norms stay in PyTorch
    rope(q), rope(k), cache_write(k, v)  # kernels, in place (from 32 rows on all threads)
    decodes: decode_attention(q)         # kernel, reads the paged cache in place (on all
                                         # threads from 1024 context tokens)
    prefill chunks: prefill_attention(q) # kernel, the same, on all threads; SDPA
                                         # (engine.layers.attention) where head_dim % 64 != 0
    x = rms_norm(h += o_proj(attn))      # GEMM, then one kernel for add and norm
    h += down_proj(silu_mul(gate_up_proj(x)))   # kernel (from 32 rows on all threads)

The residual stream ``h`` is updated in place: the layer returns the tensor it was given.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cpu.kernels import CpuKernels
from engine.layers.attention import AttentionMetadata, attend_prefills
from engine.layers.fused import FusedAttention, FusedMLP, RMSNorm

PARALLEL_MIN_ROWS = 32
"""Rows from which the norms, SiLU-and-multiply, RoPE and the cache write share their rows
among the threads: below, waking them costs about what they save. The threshold came from
timing SiLU-and-multiply and add-and-RMSNorm on one thread against all of them at each row
count; RoPE and the cache write took it over without a sweep of their own. Prefill
throughput with and without: ``python -m bench.peers``' offline prefill rows
(``bench/results/peers.md``)."""


class KernelDecoderLayer(nn.Module):
    """One decoder layer with :mod:`engine.cpu.kernels` between its GEMMs.

    Takes the projections and norms of a layer that :func:`engine.layers.fused.fuse_layers`
    has fused (and possibly prepacked). ``hidden_states`` ``[1, T, hidden]`` in, the same
    tensor out, updated in place; the step's :class:`AttentionMetadata` comes as the
    ``attn_metadata`` keyword, as for the layers it replaces.

    Raises:
        ValueError: the layer is not fused, or its MLP's activation is not SiLU.
    """

    def __init__(self, layer: nn.Module, kernels: CpuKernels) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (
            isinstance(attn, FusedAttention)
            and isinstance(mlp, FusedMLP)
            and all(isinstance(n, RMSNorm) for n in norms)
        ):
            raise ValueError("KernelDecoderLayer needs a layer fused by fuse_layers")
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"KernelDecoderLayer runs SiLU MLPs, not {type(mlp.act_fn)}")
        self.kernels = kernels
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = norms
        self.prefill_kernel = attn.head_dim % 64 == 0
        """Prefill chunks are attended by the kernel (else by SDPA, with the step's
        ``AttentionMetadata.prefills``)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attn_metadata: AttentionMetadata | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if attn_metadata is None:
            raise ValueError("KernelDecoderLayer needs attn_metadata; run it through the engine")
        k, n1, n2 = self.kernels, self.input_layernorm, self.post_attention_layernorm
        h = hidden_states[0]
        par = len(h) >= PARALLEL_MIN_ROWS
        x = k.rms_norm(h, n1.weight, n1.eps, parallel=par)
        cos, sin = (t[0] for t in position_embeddings)
        attn = self._attention(x, cos.contiguous(), sin.contiguous(), attn_metadata, par)
        x = k.rms_norm(h, n2.weight, n2.eps, delta=attn, parallel=par)
        mlp = self.mlp
        h += mlp.down_proj(k.silu_mul(mlp.gate_up_proj(x), parallel=par))
        return hidden_states

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        md: AttentionMetadata,
        par: bool,
    ) -> torch.Tensor:
        """``[T, hidden]`` in (normed), the attention block's output ``[T, hidden]``;
        ``par``: RoPE and the cache write on all threads."""
        a, k = self.self_attn, self.kernels
        t, d = x.shape[0], a.head_dim
        qkv = a.qkv_proj(x)
        q = qkv[:, : a.q_size].view(t, -1, d)
        key = qkv[:, a.q_size : a.q_size + a.kv_size].view(t, -1, d)
        value = qkv[:, a.q_size + a.kv_size :]
        if a.q_norm is not None:
            q, key = a.q_norm(q), a.k_norm(key)
        k.rope_(q, cos, sin, parallel=par)
        k.rope_(key, cos, sin, parallel=par)
        k_cache, v_cache = md.kv_caches[a.layer_idx]
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        k.cache_write(
            key.reshape(t, a.kv_size),
            value,
            md.slot_mapping,
            k_flat.view(-1, a.kv_size),
            v_flat.view(-1, a.kv_size),
            parallel=par,
        )
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            k.decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                md.block_tables[:nd],
                md.context_lens[:nd],
                a.scaling,
                out[:nd],
            )
        if self.prefill_kernel and len(md.context_lens) > nd:
            k.prefill_attention(
                q,
                k_cache,
                v_cache,
                md.block_tables,
                md.query_start_loc,
                md.context_lens,
                nd,
                a.scaling,
                out,
            )
        elif md.prefills:
            attend_prefills(md, q, key, value.view(t, -1, d), k_flat, v_flat, a.scaling, out)
        return a.o_proj(out.view(t, -1))


def use_kernel_layers(model: nn.Module, kernels: CpuKernels) -> int:
    """Swap each fused decoder layer of ``model`` for a :class:`KernelDecoderLayer`, in place.

    Returns:
        The number of layers swapped.

    Raises:
        ValueError: a layer is not fused or not SiLU (no layer is swapped then).
    """
    layers = model.model.layers
    swapped = [KernelDecoderLayer(layer, kernels) for layer in layers]
    for i, layer in enumerate(swapped):
        layers[i] = layer
    return len(swapped)
