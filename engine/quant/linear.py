"""Linear and embedding layers on packed weights (:mod:`engine.quant.kernels`).

:class:`QuantLinear` is ``nn.Linear``'s drop-in: ``[..., k]`` fp32 in, ``[..., n]`` out. Its
weight is a list of row blocks ("parts"), each packed in its own format or, for a type the
kernels do not cover, plain fp32: the fused projections (:mod:`engine.layers.fused`) join
q, k and v, or gate and up, whose formats may differ (a Q4_K_M file keeps some ``attn_v``
in Q6_K). Each part writes its own columns of the one output.

:class:`QuantEmbedding` looks rows up in a packed embedding, de-quantizing only the rows
asked for; a tied LM head is a :class:`QuantLinear` on the same :class:`PackedTensor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.formats import PackedTensor
from engine.quant.kernels import QuantKernels

Part = PackedTensor | torch.Tensor
"""A row block of a weight: packed, or fp32 ``[rows, k]``."""


def part_rows(part: Part) -> int:
    return part.rows if isinstance(part, PackedTensor) else part.shape[0]


def part_bytes(part: Part) -> int:
    return part.nbytes if isinstance(part, PackedTensor) else part.numel() * part.element_size()


class QuantLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` the row blocks ``parts`` stacked; a drop-in for
    ``nn.Linear`` (fp32 on the CPU, ``x`` ``[..., in_features]``).

    Raises:
        ValueError: no parts, or parts of different widths, or a bias of the wrong size.
    """

    def __init__(
        self,
        parts: list[Part],
        in_features: int,
        kernels: QuantKernels,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not parts:
            raise ValueError("QuantLinear needs at least one part")
        for p in parts:
            k = p.k if isinstance(p, PackedTensor) else p.shape[1]
            if k != in_features:
                raise ValueError(f"a part of width {k} in a linear of {in_features} inputs")
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(part_rows(p) for p in parts)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} for {self.out_features} outputs")
        self.register_buffer("bias", None if bias is None else bias.contiguous(), persistent=False)
        self.kernels = kernels
        self._single = parts[0] if len(parts) == 1 and isinstance(parts[0], PackedTensor) else None
        if self._single is not None:
            self._call, self._threads = kernels.matmul_call()
            w = self._single
            self._args = (w.fmt.type_id, w.data.data_ptr(), w.data.shape[1], w.rows, w.k)
            self._bias_ptr = None if bias is None else self.bias.data_ptr()
        # The packed bytes are buffers, so that the module's memory is counted with the rest.
        for i, p in enumerate(parts):
            self.register_buffer(
                f"part{i}", p.data if isinstance(p, PackedTensor) else p, persistent=False
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (the bias included)."""
        bias = 0 if self.bias is None else self.bias.numel() * 4
        return sum(part_bytes(p) for p in self.parts) + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._single is not None and x.dim() == 2 and x.stride(1) == 1:
            # The decoder layers' case, kept short: this call runs some 120 times a step.
            out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
            self._call(
                *self._args,
                x.data_ptr(),
                x.stride(0),
                x.shape[0],
                out.data_ptr(),
                self.out_features,
                self._bias_ptr,
                self._threads(),
            )
            return out
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
        col = 0
        for p in self.parts:
            n = part_rows(p)
            dst = out[:, col : col + n]
            bias = None if self.bias is None else self.bias[col : col + n]
            if isinstance(p, PackedTensor):
                self.kernels.matmul(p, x2, dst, bias)
            else:
                dst.copy_(F.linear(x2, p, bias))
            col += n
        return out.view(*lead, self.out_features)

    def formats(self) -> list[str]:
        return [p.fmt.name if isinstance(p, PackedTensor) else "F32" for p in self.parts]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, formats={'+'.join(self.formats())}"
        )


def concat_linears(parts: list[nn.Module], kernels: QuantKernels) -> QuantLinear:
    """One :class:`QuantLinear` whose output is the given layers' outputs side by side
    (each a :class:`QuantLinear` or an ``nn.Linear``); the fused projections' join.

    Raises:
        ValueError: only some layers have a bias, or their widths differ.
    """
    blocks: list[Part] = []
    biases = []
    for m in parts:
        if isinstance(m, QuantLinear):
            blocks.extend(m.parts)
            biases.append(m.bias)
        else:
            blocks.append(m.weight.detach())
            biases.append(m.bias)
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("cannot fuse linear layers where only some have a bias")
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return QuantLinear(_merge(blocks), parts[0].in_features, kernels, bias)


def _merge(blocks: list[Part]) -> list[Part]:
    """Adjacent packed blocks of one format joined into one (one kernel call, not three)."""
    merged: list[Part] = []
    for b in blocks:
        prev = merged[-1] if merged else None
        if (
            isinstance(b, PackedTensor)
            and isinstance(prev, PackedTensor)
            and prev.fmt == b.fmt
            and prev.k == b.k
        ):
            merged[-1] = PackedTensor(b.fmt, torch.cat([prev.data, b.data]), b.k)
        elif isinstance(b, torch.Tensor) and isinstance(prev, torch.Tensor):
            merged[-1] = torch.cat([prev, b])
        else:
            merged.append(b)
    return merged


class QuantEmbedding(nn.Module):
    """``nn.Embedding``'s lookup on a packed table ``[num_embeddings, embedding_dim]``:
    token ids (int64, any shape) in, ``[*ids.shape, embedding_dim]`` fp32 out."""

    def __init__(self, table: PackedTensor, kernels: QuantKernels) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.rows, table.k
        self.kernels = kernels
        self.register_buffer("packed", table.data, persistent=False)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Raises:
        IndexError: an id outside the table (the kernel would read past it)."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside the embedding of {self.num_embeddings} rows")
        return self.kernels.expand(self.table, ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.table.fmt.name}"
