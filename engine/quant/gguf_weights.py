"""A GGUF file's weights under transformers' parameter names, quantized ones kept packed.

gguf-py (``gguf.GGUFReader``) reads the file; this module maps its tensors onto the names of
a transformers model (gguf-py's own ``TensorNameMap``, as transformers' GGUF loader does)
and undoes what llama.cpp's converter did to them:

* the converter permutes the rows of ``attn_q`` and ``attn_k`` of ``llama``-architecture
  models (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: each head's two rotary halves
  interleaved); transformers undoes it (``LlamaTensorProcessor``), and so does
  :func:`unpermute_rows`, on whole packed rows, which blocks never cross;
* a GGUF tensor's shape is ``[k, rows]`` (ggml order); its data is ``rows`` packed rows.

Packed rows are copied out of the memory-mapped file into tensors of their own, so no
mapping outlives the load and no fp32 copy of a packed weight is made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.quant.formats import FORMATS, PackedTensor

logger = logging.getLogger(__name__)

FLOAT_TYPES = ("F32", "F16", "BF16")
PERMUTED_ARCHITECTURES = frozenset({"llama"})
"""GGUF architectures whose q/k rows llama.cpp's converter permutes (transformers undoes
the permutation for these only)."""


class GGUFWeightError(ValueError):
    """The file lacks a tensor the model needs, or holds one of the wrong shape."""


@dataclass
class GGUFWeights:
    """The weights of one GGUF file by transformers name: a :class:`PackedTensor` for each
    tensor kept packed, an fp32 tensor for the rest."""

    tensors: dict[str, PackedTensor | torch.Tensor]
    architecture: str
    dequantized_types: frozenset[str]
    """Quantized types in the file that the kernels do not cover: de-quantized to fp32."""

    def packed_types(self) -> list[str]:
        """The names of the packed formats in use, most bytes first."""
        size: dict[str, int] = {}
        for t in self.tensors.values():
            if isinstance(t, PackedTensor):
                size[t.fmt.name] = size.get(t.fmt.name, 0) + t.nbytes
        return sorted(size, key=lambda n: -size[n])


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation on a matrix's rows (any trailing shape).

    The converter maps each head's rows ``[2, half]`` to ``[half, 2]``; this maps them back,
    as transformers' ``_reverse_permute_weights`` does to de-quantized weights."""
    n = rows.shape[0]
    half = n // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_gguf_weights(
    path: Path, names: Iterable[str], config, keep_packed: bool = True
) -> GGUFWeights:
    """Read the tensors behind ``names`` (a transformers model's parameter names) from the
    GGUF file at ``path``.

    Args:
        config: the model's transformers config (heads, for the q/k permutation).
        keep_packed: keep the formats in :data:`engine.quant.formats.FORMATS` packed; else
            de-quantize every tensor to fp32.

    A name with no tensor in the file is left out (a tied ``lm_head.weight``). Every
    non-float type outside the kernels' formats is de-quantized to fp32 (gguf-py's
    ``gguf.quants.dequantize``).

    Raises:
        GGUFWeightError: an unknown architecture, or a tensor whose shape disagrees with
            the config.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    arch_ids = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in arch_ids:
        raise GGUFWeightError(f"{path}: unknown GGUF architecture {arch!r}")
    name_map = gguf.get_tensor_name_map(arch_ids[arch], config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, PackedTensor | torch.Tensor] = {}
    dequantized: set[str] = set()
    for name in names:
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        t = by_name.get(gguf_name) if gguf_name else None
        if t is None:
            continue
        type_name = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml order is [k, rows]
        data = np.asarray(t.data)
        n_head = None
        if arch in PERMUTED_ARCHITECTURES and len(shape) == 2:
            if ".attn_q." in gguf_name:
                n_head = heads
            elif ".attn_k." in gguf_name:
                n_head = kv_heads
        if keep_packed and type_name in FORMATS and len(shape) == 2:
            rows = data.reshape(shape[0], -1)
            if n_head:
                rows = unpermute_rows(rows, n_head)
            packed = torch.from_numpy(np.ascontiguousarray(rows).copy())
            out[name] = PackedTensor(FORMATS[type_name], packed, shape[1])
            continue
        if type_name in FLOAT_TYPES:
            values = data.astype(np.float32)
        else:
            values = gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)
            dequantized.add(type_name)
        values = values.reshape(shape)
        if n_head:
            values = unpermute_rows(values, n_head)
        out[name] = torch.from_numpy(np.ascontiguousarray(values).copy())
    del reader
    if keep_packed and dequantized:
        logger.info(
            "%s: %s not covered by the packed-weight kernels: de-quantized to float32",
            path.name,
            ", ".join(sorted(dequantized)),
        )
    return GGUFWeights(out, arch, frozenset(dequantized) if keep_packed else frozenset())
