"""A PEFT LoRA adapter read from its directory, checked against the base model.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021) adds to a
frozen projection ``W`` (``[out, in]``) a low-rank update: ``y = x W^T + s * (x A^T) B^T``
with ``A`` ``[r, in]``, ``B`` ``[out, r]`` and the scale ``s = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023). PEFT saves ``A`` and ``B`` of
each adapted module as ``...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` in
``adapter_model.safetensors``, with its settings in ``adapter_config.json``.

:func:`load_adapter` reads both, refuses what the engine cannot apply exactly (DoRA,
trained biases, extra trained modules, per-module alphas, other PEFT methods), and keeps
``s * B`` so that applying it is two matrix products.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, in a Llama-family decoder layer."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter directory the engine cannot use; the message says why."""


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """A target projection's ``(in_features, out_features)``."""

    in_features: int
    out_features: int


@dataclass(slots=True)
class LoRAAdapter:
    """One loaded adapter: per ``(layer, target)``, ``(A [r, in], s * B [out, r])`` in fp32."""

    name: str
    path: str
    rank: int
    """The largest rank among its modules."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: bytes
    """Identifies these weights (name, path, the files' sizes and times): the prefix cache
    salts its block hashes with it, since one prompt under two adapters has two KV."""

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(t for _, t in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(
    name: str,
    path: str | Path,
    shapes: dict[str, ModuleShape],
    num_layers: int,
    max_rank: int,
) -> LoRAAdapter:
    """Read the PEFT LoRA adapter in directory ``path``.

    Args:
        shapes: the base model's target projections by name (:data:`TARGETS`).
        num_layers: the base model's decoder layers.
        max_rank: the largest rank the engine takes (``max_lora_rank``).

    Raises:
        AdapterError: a missing or unreadable directory or file, another PEFT method, a
            rank above ``max_rank``, a module or shape that does not match the base
            model, or a setting the engine does not apply.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not root.is_dir():
        raise AdapterError(f"adapter {name!r}: {str(root)!r} is not a directory")
    for f in (config_path, weights_path):
        if not f.is_file():
            raise AdapterError(f"adapter {name!r}: {f.name} is missing in {str(root)!r}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} does not parse: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    _check_config(name, config)
    try:
        tensors = load_file(weights_path)
    except (OSError, SafetensorError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} does not load: {e}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A or B of a decoder "
                f"layer's projection ({', '.join(TARGETS)})"
            )
        layer, target, ab = int(m[1]), m[2], m[3]
        if target not in TARGETS or target not in shapes:
            raise AdapterError(
                f"adapter {name!r}: module {target!r} is not a target here; "
                f"targets: {', '.join(t for t in TARGETS if t in shapes)}"
            )
        if not 0 <= layer < num_layers:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} of {key!r}; the model has {num_layers}"
            )
        pairs.setdefault((layer, target), {})[ab] = t
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {target} lacks lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        shape, r = shapes[target], a.shape[0]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != shape.in_features
            or b.shape != (shape.out_features, r)
        ):
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {target}: A {tuple(a.shape)} and B "
                f"{tuple(b.shape)} do not fit the model's [{shape.out_features}, "
                f"{shape.in_features}] projection (another base model?)"
            )
        if r > max_rank:
            raise AdapterError(
                f"adapter {name!r}: rank {r} at layer {layer} {target} is above "
                f"max_lora_rank {max_rank}"
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        weights[(layer, target)] = (a.contiguous(), (b * scale).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(
        name, str(root), rank, weights, _identity(name, root, (config_path, weights_path))
    )


def _check_config(name: str, config: dict) -> None:
    """Refuse the PEFT settings that :func:`load_adapter` would not apply exactly."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r}; only LORA is served")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "alpha_pattern": "alpha_pattern (per-module alphas)",
        "layer_replication": "layer_replication",
        "use_qalora": "QA-LoRA",
    }
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {what} is not supported")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(f"adapter {name!r}: bias {bias!r} is not supported (only 'none')")


def _identity(name: str, root: Path, files: tuple[Path, ...]) -> bytes:
    h = hashlib.sha256(f"{name}\0{root.resolve()}".encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.digest()
