"""Decode steps through all decoder layers in one C call (``engine/quant/decode.c``).

A step whose rows are all decodes spends, at one to a few rows, more time dispatching
Python between kernels than in the kernels themselves: some fifteen calls a layer, each a
few microseconds. :class:`DecodeStack` runs the same layer sequence as
:class:`engine.cpu.kernel_layers.KernelDecoderLayer` (RMSNorm, the fused q/k/v product, RoPE,
the cache write, decode attention, the output product, add and RMSNorm, gate/up, SiLU and
multiply, down, add), with the same kernels in the same order, from C; the embedding, the
final norm and the LM head stay the model's own modules. The logits are therefore the same
bit for bit as the model's forward gives (``tests/test_quant_model.py`` holds them equal).

It applies to models loaded with packed weights on the ``cpu_kernels`` backend whose
projections are packed (up to :data:`QLIN_PARTS` parts of any formats each) and whose layers
have no per-head q/k norms (Qwen3's); :meth:`build` returns None otherwise, and such models
run their forward as before.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine.cpu.kernel_layers import KernelDecoderLayer
from engine.cpu.kernels import KV_TYPES, CpuKernels
from engine.layers.attention import AttentionMetadata
from engine.quant.formats import PackedTensor
from engine.quant.kernels import QuantKernels
from engine.quant.linear import QuantLinear

_I, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _QPart(ctypes.Structure):
    _fields_ = [("type", _I), ("w", _P), ("row_bytes", _I), ("rows", _I), ("k", _I)]


QLIN_PARTS = 3
"""Row blocks a projection may have (``QLIN_PARTS`` in ``engine/quant/decode.c``)."""


class _QLin(ctypes.Structure):
    _fields_ = [
        ("nparts", _I),
        ("rows", _I),
        ("parts", _QPart * QLIN_PARTS),
        ("bias", _P),
    ]


class _DLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", _QLin),
        ("o", _QLin),
        ("gate_up", _QLin),
        ("down", _QLin),
        ("norm1", _P),
        ("norm2", _P),
        ("eps1", _F),
        ("eps2", _F),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class _DStep(ctypes.Structure):
    _fields_ = [
        ("rows", _I),
        ("cos", _P),
        ("sin", _P),
        ("slots", _P),
        ("tables", _P),
        ("table_stride", _I),
        ("lens", _P),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("block_size", _I),
        ("intermediate", _I),
        ("scale", _F),
        ("threads", _I),
        ("kv_type", _I),
        ("rms_norm", _P),
        ("silu_mul", _P),
        ("rope", _P),
        ("cache_write", _P),
        ("decode_attention", _P),
    ]


def _qlin(m: nn.Module) -> _QLin | None:
    """The projection for C, or None where it has a float part or too many parts."""
    if not isinstance(m, QuantLinear) or len(m.parts) > QLIN_PARTS:
        return None
    if not all(isinstance(p, PackedTensor) for p in m.parts):
        return None
    parts = [
        _QPart(p.fmt.type_id, p.data.data_ptr(), p.data.shape[1], p.rows, p.k) for p in m.parts
    ]
    bias = None if m.bias is None else m.bias.data_ptr()
    return _QLin(len(parts), m.out_features, (_QPart * QLIN_PARTS)(*parts), bias)


class DecodeStack:
    """Runs a decode-only step of a packed model: :meth:`__call__` gives the logits of the
    rows ``keep`` as the model's forward would. Built by :meth:`build`."""

    def __init__(self, model: nn.Module, layers: list, step: _DStep, quant: QuantKernels):
        self.model = model
        self._layers = (_DLayer * len(layers))(*layers)
        self._n = len(layers)
        self._step = step
        self._quant = quant
        self._scratch_per_row = (
            step.hidden * 2
            + (step.heads + 2 * step.kv_heads) * step.head_dim
            + step.heads * step.head_dim
            + 3 * step.intermediate
        )

    @classmethod
    def build(
        cls,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kernels: CpuKernels,
        quant: QuantKernels,
    ) -> DecodeStack | None:
        """The stack for ``model`` (a transformers causal LM whose decoder layers are
        :class:`KernelDecoderLayer` on single-part :class:`QuantLinear` projections), or
        None where it does not apply."""
        layers = list(model.model.layers)
        if not layers or not all(isinstance(x, KernelDecoderLayer) for x in layers):
            return None
        built = []
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            a, mlp = layer.self_attn, layer.mlp
            lins = [_qlin(m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(x is None for x in lins) or a.q_norm is not None:
                return None
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            built.append(
                _DLayer(
                    *lins,
                    n1.weight.data_ptr(),
                    n2.weight.data_ptr(),
                    n1.eps,
                    n2.eps,
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                )
            )
        a = layers[0].self_attn
        _, block_size, kv_heads, head_dim = kv_caches[0][0].shape
        step = _DStep(
            hidden=model.config.hidden_size,
            heads=a.q_size // head_dim,
            kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            intermediate=layers[0].mlp.intermediate,
            scale=a.scaling,
            kv_type=KV_TYPES[kv_caches[0][0].dtype],
            rms_norm=kernels.address("add_rms_norm"),
            silu_mul=kernels.address("silu_mul"),
            rope=kernels.address("rope"),
            cache_write=kernels.address("cache_write"),
            decode_attention=kernels.address("decode_attention"),
        )
        stack = cls(model, built, step, quant)
        stack._parallel = kernels.parallel and quant.parallel
        return stack

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Logits ``[len(keep), vocab]`` of a step whose ``len(input_ids)`` rows are all
        decodes (one token each).

        Raises:
            RuntimeError: a kernel failed (its code in the message).
        """
        m = self.model.model
        h = m.embed_tokens(input_ids)
        cos, sin = m.rotary_emb(h[None], positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        t = h.shape[0]
        st = self._step
        st.rows = t
        st.cos, st.sin = cos.data_ptr(), sin.data_ptr()
        st.slots = md.slot_mapping.data_ptr()
        st.tables, st.table_stride = md.block_tables.data_ptr(), md.block_tables.stride(0)
        st.lens = md.context_lens.data_ptr()
        st.threads = torch.get_num_threads() if self._parallel else 1
        scratch = torch.empty(t * self._scratch_per_row, dtype=torch.float32)
        rc = self._quant.decode_layers(
            self._layers, self._n, ctypes.byref(st), h.data_ptr(), scratch.data_ptr()
        )
        if rc:
            raise RuntimeError(f"q_decode_layers failed: {rc}")
        return self.model.lm_head(m.norm(h)[keep])
