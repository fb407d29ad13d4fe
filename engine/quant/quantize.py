"""Weight-only quantization of fp32 weights at load (``quantization: int8 | int4``).

* ``int8``: one fp32 scale per output row, ``s = max|w| / 127``, ``q = round(w / s)``
  (symmetric, per output channel), packed as :data:`engine.quant.formats.FORMATS`' ``I8R``.
* ``int4``: groups of 32 weights along the row with a scale and a minimum (asymmetric),
  packed as GGUF's ``Q4_1``: ``d = (max - min) / 15`` and ``m = min`` in fp16,
  ``q = round((w - m) / d)`` clamped to [0, 15], computed with the fp16 ``d`` and ``m`` so
  that ``q d + m`` is the nearest value the block can hold. ggml's ``quantize_row_q4_1_ref``
  is the same scheme with the unrounded ``d`` and ``m``.

Activations stay fp32; :mod:`engine.quant.kernels` expands the weights in registers.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine.quant.formats import FORMATS, PackedTensor

WeightQuantization = Literal["int8", "int4"]


def quantize_int8(w: torch.Tensor) -> PackedTensor:
    """``w`` (``[rows, k]``, ``k % 32 == 0``) as ``I8R`` rows."""
    w = w.detach().to(torch.float32)
    rows, k = w.shape
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    data = torch.empty((rows, FORMATS["I8R"].row_bytes(k)), dtype=torch.uint8)
    data[:, :4] = scale.contiguous().view(torch.uint8).view(rows, 4)
    data[:, 4:] = q.view(torch.uint8)
    return PackedTensor(FORMATS["I8R"], data, k)


def quantize_int4(w: torch.Tensor) -> PackedTensor:
    """``w`` (``[rows, k]``, ``k % 32 == 0``) as ``Q4_1`` rows."""
    w = w.detach().to(torch.float32)
    rows, k = w.shape
    fmt = FORMATS["Q4_1"]
    groups = w.view(rows, k // 32, 32)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    d32, m32 = d.to(torch.float32), m.to(torch.float32)
    safe = torch.where(d32 > 0, d32, torch.ones_like(d32))
    q = torch.round((groups - m32[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    q = torch.where((d32 > 0)[..., None], q, torch.zeros_like(q))
    blocks = torch.empty((rows, k // 32, fmt.block_bytes), dtype=torch.uint8)
    blocks[..., 0:2] = d.view(torch.uint8).view(rows, k // 32, 2)
    blocks[..., 2:4] = m.view(torch.uint8).view(rows, k // 32, 2)
    blocks[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return PackedTensor(fmt, blocks.view(rows, -1).contiguous(), k)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
