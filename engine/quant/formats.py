"""The packed weight formats the kernels of :mod:`engine.quant.kernels` multiply.

A packed weight is a matrix ``[rows, k]`` stored as ``rows`` rows of bytes, each row the
blocks of its ``k`` weights in order. The GGUF formats are ggml's (``ggml-common.h``; the
block layouts are written out in ``engine/quant/kernels.c``); ``I8R`` is the project's own
for ``quantization: int8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    """A block format: ``block_weights`` weights in ``block_bytes`` bytes, after
    ``row_prefix_bytes`` bytes that the whole row shares (``I8R``'s scale)."""

    name: str
    type_id: int
    """ggml's ``ggml_type`` number (``I8R``: 1024, outside ggml's range)."""
    block_weights: int
    block_bytes: int
    row_prefix_bytes: int = 0

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of ``k`` weights.

        Raises:
            ValueError: ``k`` is not a multiple of the block.
        """
        if k % self.block_weights:
            raise ValueError(f"{self.name} rows hold multiples of {self.block_weights} weights")
        return self.row_prefix_bytes + k // self.block_weights * self.block_bytes


FORMATS = {
    f.name: f
    for f in (
        Format("Q4_0", 2, 32, 18),
        Format("Q4_1", 3, 32, 20),
        Format("Q5_0", 6, 32, 22),
        Format("Q5_1", 7, 32, 24),
        Format("Q8_0", 8, 32, 34),
        Format("Q4_K", 12, 256, 144),
        Format("Q5_K", 13, 256, 176),
        Format("Q6_K", 14, 256, 210),
        Format("I8R", 1024, 32, 32, row_prefix_bytes=4),
    )
}
"""Every format the kernels multiply, by name (GGUF's names for its own)."""


@dataclass(frozen=True)
class PackedTensor:
    """A weight matrix ``[rows, k]`` kept packed: ``data`` is ``[rows, fmt.row_bytes(k)]``
    uint8 on the CPU, row ``n`` holding weight row ``n``."""

    fmt: Format
    data: torch.Tensor
    k: int

    def __post_init__(self) -> None:
        want = (self.data.shape[0], self.fmt.row_bytes(self.k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.fmt.name} data for k={self.k} must be uint8 {want}, "
                f"not {self.data.dtype} {tuple(self.data.shape)}"
            )
        if not self.data.is_contiguous():
            raise ValueError("packed data must be contiguous")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()
