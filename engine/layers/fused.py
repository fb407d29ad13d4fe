"""Fused projections and norms for the decoder layers of the supported architectures.

transformers' Llama-family layers run q, k and v as three GEMMs and the MLP's gate and up
as two, each over the same input, and compute RMSNorm in seven tensor ops. At decode row
counts (1-64 tokens a step) a GEMM's cost is mostly reading its weight, and every op costs
a fixed dispatch, so two GEMMs over concatenated weights cost less than five.
Serving engines concatenate these weights at load (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``); this module does the same by swapping three leaf
modules per layer, and leaves the model's skeleton (embedding, layer loop, rotary
embedding, LM head) to transformers.

The swapped modules hold plain ``nn.Linear`` children, so :func:`engine.cpu.linear.prepack_linears`
then prepacks the fused weights like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import paged_attention

Concat = Callable[[list[nn.Module]], "nn.Module | None"]
"""Joins linear layers whose outputs go side by side into one layer, or declines (None) for
:func:`concat_linear` to do it: the loader's hook for layers that are not ``nn.Linear``
(:func:`engine.quant.linear.concat_linears` for packed weights)."""


def concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the parts' outputs side by side."""
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        raise ValueError("cannot fuse linear layers where only some have a bias")
    w = parts[0].weight
    fused = nn.Linear(
        w.shape[1],
        sum(p.out_features for p in parts),
        bias=has_bias,
        device=w.device,
        dtype=w.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` in one ``F.rms_norm`` call (Zhang and Sennrich,
    2019); input and output ``[..., hidden]``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class FusedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up as one GEMM; ``[..., hidden]`` in and out."""

    def __init__(self, mlp: nn.Module, concat: Concat | None = None) -> None:
        super().__init__()
        self.intermediate = mlp.gate_proj.out_features
        self.gate_up_proj = _join([mlp.gate_proj, mlp.up_proj], concat)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class FusedAttention(nn.Module):
    """The layer's attention with q, k and v as one GEMM, attending through
    :func:`engine.layers.attention.paged_attention`.

    Keeps the source module's per-head q/k norms (Qwen3) and its RoPE. ``hidden_states``
    ``[1, T, hidden]`` in, ``[1, T, hidden]`` out; the step's metadata comes as the
    ``attn_metadata`` keyword, as for transformers' attention interface.
    """

    def __init__(self, attn: nn.Module, apply_rotary, concat: Concat | None = None) -> None:
        super().__init__()
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.qkv_proj = _join([attn.q_proj, attn.k_proj, attn.v_proj], concat)
        self.o_proj = attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.apply_rotary = apply_rotary

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask=None,
        attn_metadata=None,
        **kwargs,
    ):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out, _ = paged_attention(
            self, q, k, v.transpose(1, 2), None, scaling=self.scaling, attn_metadata=attn_metadata
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def _join(parts: list[nn.Module], concat: Concat | None) -> nn.Module:
    joined = concat(parts) if concat is not None else None
    return joined if joined is not None else concat_linear(parts)


def fuse_layers(model: nn.Module, concat: Concat | None = None) -> int:
    """Swap each decoder layer's attention, MLP and RMSNorms for the fused modules, in place.

    Applies to the Llama-family layout (``model.model.layers[i].self_attn / .mlp /
    .input_layernorm / .post_attention_layernorm``) shared by the supported architectures.
    ``concat`` joins projections that are not all ``nn.Linear`` (see :data:`Concat`).

    Returns:
        The number of layers swapped.

    Raises:
        ValueError: a layer lacks the expected projections or norms.
    """
    import importlib

    layers = model.model.layers
    rope = importlib.import_module(type(layers[0].self_attn).__module__).apply_rotary_pos_emb
    for layer in layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(getattr(layer.self_attn, name, None), "out_features"):
                raise ValueError(f"attention layer has no linear {name}")
        layer.self_attn = FusedAttention(layer.self_attn, rope, concat)
        layer.mlp = FusedMLP(layer.mlp, concat)
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, _rms_norm(getattr(layer, name)))
    model.model.norm = _rms_norm(model.model.norm)
    return len(layers)


def _rms_norm(norm: nn.Module) -> RMSNorm:
    """The fused equivalent of a transformers RMSNorm (its epsilon is ``variance_epsilon``).

    Raises:
        ValueError: ``norm`` has no ``weight`` or no ``variance_epsilon`` (guessing an
            epsilon would change the outputs silently).
    """
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        raise ValueError(
            f"{type(norm).__name__} is not an RMSNorm with weight and variance_epsilon"
        )
    return RMSNorm(norm.weight, eps)
