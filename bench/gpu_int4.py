"""The GPU check's int4 step (:mod:`bench.gpu_check`, ``--int4``): torch's CUDA int4
weight-only products (``torch.ops.aten._weight_int4pack_mm``, bf16 activations, groups of
:data:`INT4_GROUP` with a scale and a zero point) against bf16 products on the same
de-quantized weights, at the model's linear shapes. torch is imported where it is used, as
in the check itself."""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Any

INT4_GROUP = 32
INT4_REPS = 20


def int4_pack(w, group: int = INT4_GROUP):
    """``w`` (``[n, k]``) for ``_weight_int4pack_mm``: ``(q, scale_and_zero, dequantized)``.

    Per group of ``group`` weights along ``k``: ``scale = (max - min) / 15`` and
    ``zero = min + 8 scale``, so that ``(q - 8) scale + zero`` (the kernel's de-quantization)
    is ``q scale + min``, as Q4_1 stores it; ``q`` in [0, 15], two to a byte (``[n, k / 2]``
    uint8, the even column in the high nibble); ``scale_and_zero`` ``[k / group, n, 2]`` in
    ``w``'s dtype."""
    import torch

    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    deq = (q.float() * scale[..., None] + lo[..., None]).view(n, k).to(w.dtype)
    q = q.view(n, k)
    packed = (q[:, ::2] << 4) | q[:, 1::2]
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(w.dtype)
    return packed.contiguous(), sz, deq


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """``(n, k)`` of each linear weight of one layer (q/k/v fused, o, gate/up fused, down) and
    of the LM head, from a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "qkv": (q + 2 * kv, h),
        "o": (h, q),
        "gate_up": (2 * i, h),
        "down": (h, i),
        "lm_head": (config.vocab_size, h),
    }


def cuda_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls (CUDA events), after one warm-up."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def int4_products(model_dir: Path, rows: tuple[int, ...]) -> dict[str, Any]:
    """bf16 against int4 products at each of the model's linear shapes (:func:`linear_shapes`
    of the config in ``model_dir``) and each row count of ``rows``, on CUDA: per shape and
    row count (``"{name} {n}x{k}"`` -> ``str(m)``) ``bf16_ms`` / ``int4_ms`` (medians of
    :data:`INT4_REPS`), ``speedup`` and ``rel_error`` (the largest error relative to the
    bf16 product's largest value); ``per_forward`` the sums over one forward's products
    (every layer's four, the LM head once). Needs CUDA."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    layers = config.num_hidden_layers
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes, totals = {}, {m: {"bf16_ms": 0.0, "int4_ms": 0.0} for m in rows}
    for name, (n, k) in linear_shapes(config).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        packed, sz, deq = int4_pack(w)
        tiles = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        per = {}
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x @ deq.T
            got = torch.ops.aten._weight_int4pack_mm(x, tiles, INT4_GROUP, sz)
            err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
            bf = cuda_ms(functools.partial(torch.matmul, x, deq.T), INT4_REPS)
            i4 = cuda_ms(
                functools.partial(torch.ops.aten._weight_int4pack_mm, x, tiles, INT4_GROUP, sz),
                INT4_REPS,
            )
            per[str(m)] = {"bf16_ms": bf, "int4_ms": i4, "speedup": bf / i4, "rel_error": err}
            times = 1 if name == "lm_head" else layers
            totals[m]["bf16_ms"] += bf * times
            totals[m]["int4_ms"] += i4 * times
        shapes[f"{name} {n}x{k}"] = per
    forward = {str(m): {**t, "speedup": t["bf16_ms"] / t["int4_ms"]} for m, t in totals.items()}
    return {"group": INT4_GROUP, "shapes": shapes, "per_forward": forward}
