"""One replica's LoRA adapters: those kept in host memory, the step's slots, and the
projections that apply them (:mod:`engine.lora.layers`)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine.core.params import LoRARequest
from engine.layers.fused import FusedAttention, FusedMLP
from engine.lora.adapter import AdapterError, LoRAAdapter, ModuleShape, load_adapter
from engine.lora.layers import LoRAProjection, LoRAStep, Target


class LoRAManager:
    """Loads adapters on first use, keeps the ``max_cpu_loras`` most recently used in host
    memory, and puts a step's adapters (at most ``max_loras``) in the projections' slots.

    :meth:`get` may run on another thread than :meth:`prepare` (the engine checks requests
    on the event loop's thread and steps on its own): the host-memory cache has a lock.

    Raises:
        ValueError: the model's decoder layers are not fused
            (:func:`engine.layers.fused.fuse_layers`), or a size below 1.
    """

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        if min(max_loras, max_lora_rank, max_cpu_loras) < 1:
            raise ValueError("max_loras, max_lora_rank and max_cpu_loras must be >= 1")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.step = LoRAStep()
        self.shapes, self.projections = _attach(model, max_loras, max_lora_rank, self.step)
        self.num_layers = len(model.model.layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype if p.is_floating_point() else torch.float32
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._slots: list[bytes | None] = [None] * max_loras
        """The key (:attr:`LoRAAdapter.key`) of each slot's adapter."""
        self._slot_use = [0] * max_loras
        self._steps = 0
        self.num_loads = 0
        """Adapters read from disk so far (first uses, and reloads after eviction)."""
        self.load_s = 0.0
        """Seconds those reads took in all."""

    def get(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter ``lora`` names, read from ``lora.path`` unless kept under its name
        with that path already; the least recently used beyond ``max_cpu_loras`` go.

        Raises:
            AdapterError: the directory cannot be served (:func:`load_adapter`).
        """
        with self._lock:
            adapter = self._cache.get(lora.name)
            # As load_adapter spells it: "dir/" or "./dir" is the adapter kept as "dir".
            if adapter is not None and adapter.path == str(Path(lora.path)):
                self._cache.move_to_end(lora.name)
                return adapter
            t0 = time.perf_counter()
            adapter = load_adapter(
                lora.name, lora.path, self.shapes, self.num_layers, self.max_lora_rank
            )
            self.load_s += time.perf_counter() - t0
            self.num_loads += 1
            self._cache[lora.name] = adapter
            self._cache.move_to_end(lora.name)
            while len(self._cache) > self.max_cpu_loras:
                self._cache.popitem(last=False)
            return adapter

    @property
    def mean_load_s(self) -> float:
        """Mean seconds an adapter's read from disk took here (0: none yet): what a
        request for an adapter not held adds to its TTFT."""
        return self.load_s / self.num_loads if self.num_loads else 0.0

    def remove(self, name: str) -> bool:
        """Forget adapter ``name`` (requests running with it finish with it); True if kept."""
        with self._lock:
            return self._cache.pop(name, None) is not None

    def loaded(self) -> list[str]:
        """The adapters kept in host memory, least recently used first."""
        with self._lock:
            return list(self._cache)

    def prepare(self, loras: Sequence[LoRARequest | None], seq_of_token: torch.Tensor) -> None:
        """Set up the step whose sequences use ``loras`` (None: the base model);
        ``seq_of_token`` ``[T]``: each row's sequence.

        Raises:
            AdapterError: an adapter evicted meanwhile no longer loads.
            RuntimeError: more distinct adapters than ``max_loras`` (the scheduler admits
                no more).
        """
        names = {lo.name: lo for lo in loras if lo is not None}
        if not names:
            self.finish()
            return
        if len(names) > self.max_loras:
            raise RuntimeError(f"{len(names)} adapters in one step; max_loras {self.max_loras}")
        self._steps += 1
        adapters = {name: self.get(lo) for name, lo in names.items()}
        slot_of: dict[str, int] = {}
        needed = {a.key for a in adapters.values()}
        for name, a in adapters.items():
            if a.key in self._slots:
                slot_of[name] = self._slots.index(a.key)
        for name, a in adapters.items():
            if name in slot_of:
                continue
            free = [i for i, k in enumerate(self._slots) if k not in needed]
            # An empty slot first, then the one unused the longest; low slots first, so
            # that the projections' passes span as few slots as they can.
            slot = min(free, key=lambda i: (self._slots[i] is not None, self._slot_use[i], i))
            for p in self.projections:
                p.load_slot(slot, a, self.device, self.dtype)
            self._slots[slot] = a.key
            slot_of[name] = slot
        for slot in slot_of.values():
            self._slot_use[slot] = self._steps
        width = max(slot_of.values()) + 1
        per_seq = torch.zeros(len(loras), width, dtype=self.dtype)
        for i, lo in enumerate(loras):
            if lo is not None:
                per_seq[i, slot_of[lo.name]] = 1.0
        self.step.onehot = per_seq[seq_of_token].to(self.device)
        self.step.slots = frozenset(slot_of.values())

    def finish(self) -> None:
        """End the step: the projections add nothing until the next :meth:`prepare`."""
        self.step.onehot = None
        self.step.slots = frozenset()


def _attach(
    model: nn.Module, num_slots: int, max_rank: int, step: LoRAStep
) -> tuple[dict[str, ModuleShape], list[LoRAProjection]]:
    """Wrap every decoder layer's four fused projections in :class:`LoRAProjection`s, in
    place; the target shapes and the wrappers."""
    cfg = model.config
    layers = model.model.layers
    projections: list[LoRAProjection] = []
    shapes: dict[str, ModuleShape] = {}
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not (isinstance(attn, FusedAttention) and isinstance(mlp, FusedMLP)):
            raise ValueError("LoRA adapters need the fused decoder layers of fuse_layers")
        hidden, inter = cfg.hidden_size, mlp.intermediate
        q, kv = attn.q_size, attn.kv_size
        groups = {
            (attn, "qkv_proj", hidden): (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            (attn, "o_proj", q): (("o_proj", hidden),),
            (mlp, "gate_up_proj", hidden): (("gate_proj", inter), ("up_proj", inter)),
            (mlp, "down_proj", inter): (("down_proj", hidden),),
        }
        for (owner, attr, in_features), parts in groups.items():
            targets, offset = [], 0
            for name, size in parts:
                targets.append(Target(name, offset, size))
                shapes[name] = ModuleShape(in_features, size)
                offset += size
            wrapped = LoRAProjection(
                getattr(owner, attr), i, tuple(targets), in_features, num_slots, max_rank, step
            )
            setattr(owner, attr, wrapped)
            projections.append(wrapped)
    return shapes, projections


__all__ = ["AdapterError", "LoRAManager"]
