"""Linear layers with oneDNN-prepacked weights, for fp32 inference on CPU.

PyTorch's ``nn.Linear`` on CPU calls MKL's sgemm on the plain ``[out, in]`` weight, which
is slow at the small row counts of decode steps (1-64 sequences); oneDNN's linear on a
prepacked weight is faster there (``python -m bench.engine_throughput`` measures both in one run:
``iterserve`` against ``iterserve_noprepack``, ``bench/results/engine_throughput.json``).
oneDNN's linear takes the weight reordered once into
its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, which torch.compile's
CPU weight freezing also emits where the row count varies, as it does here from step to
step), so the layout work is done once, not in every call.
The results equal ``F.linear``'s up to float summation order (``tests/test_cpu_linear.py``
holds them to its tolerance).

oneDNN builds and caches a primitive, with its memory, for every input shape it meets
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 entries by default). A batching loop gives a
linear a new row count at almost every step, so the cache grows with the row counts seen:
the replica's memory rises for hours.
:class:`PackedLinear` therefore runs each product at a row count rounded up to a bucket
(:func:`row_bucket`), padding the rows with zeros, which bounds the shapes, and the
memory, to a few per octave.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where prepacking applies: fp32 on a CPU build with oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


BUCKETS_PER_OCTAVE = 8
"""Row-count buckets between two powers of two (above 16): rounding up adds at most an
eighth of the rows."""


def row_bucket(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: ``rows`` itself up to 16, then
    rounded up to a multiple of an eighth of the power of two below it (17 -> 18,
    100 -> 104, 513 -> 576).

    Raises:
        ValueError: ``rows`` < 1.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if rows <= 2 * BUCKETS_PER_OCTAVE:
        return rows
    step = (1 << (rows.bit_length() - 1)) // BUCKETS_PER_OCTAVE
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN; a drop-in for ``nn.Linear``.

    Input ``[..., in_features]``, output ``[..., out_features]``, fp32 on CPU.
    ``tied`` says the source weight is shared with another module (a tied LM head's
    embedding), which keeps its own plain copy: the packed one is then extra memory.

    Raises:
        ValueError: the weight is not fp32 on a CPU with oneDNN (``prepack_supported``).
    """

    def __init__(self, linear: nn.Linear, tied: bool = False) -> None:
        w = linear.weight
        if not prepack_supported(w.device, w.dtype):
            raise ValueError(
                f"PackedLinear needs an fp32 CPU weight with oneDNN; got {w.dtype} on {w.device}"
            )
        super().__init__()
        self.in_features, self.out_features, self.tied = (
            linear.in_features,
            linear.out_features,
            tied,
        )
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight, None)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded = row_bucket(rows) if rows else 0
        if padded == rows:
            return self._product(x)
        # Zero rows beyond the input's: their outputs are computed and dropped.
        full = x.new_zeros((padded, self.in_features))
        full[:rows] = x.reshape(rows, self.in_features)
        return self._product(full)[:rows].reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tied={self.tied}"
        )


def prepack_linears(model: nn.Module, copy_rest: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    A replaced layer's plain weight is freed unless another module shares it. With
    ``copy_rest``, the tensors left (embedding, norms, biases) are then copied: weights
    loaded from safetensors are views of one memory-mapped file, which packing has read
    whole, so the mapping would stay resident beside the packed copies for as long as any
    view lives. (Weights read from a GGUF file are copies already.)

    Returns:
        The number of layers replaced.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    others = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    for name, lin in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(lin, tied=id(lin.weight) in others))
    if not copy_rest:
        logger.info("prepacked %d linear layers for oneDNN", len(linears))
        return len(linears)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
        for module in model.modules():
            for key, buf in module._buffers.items():
                if buf is not None and not buf.is_mkldnn:
                    module._buffers[key] = buf.clone()
    logger.info("prepacked %d linear layers for oneDNN", len(linears))
    return len(linears)
