"""Many LoRA adapters in one step: each projection applies every row's own adapter in
one batched pass on top of the base projection.

The adapters active in a step sit in slots (``max_loras`` of them). A fused projection
(q, k and v side by side, or gate and up) keeps, per slot, its targets' ``A`` stacked into
``a`` ``[slots, J, R, in]`` (``J`` targets, ``R = max_rank``) and, per target ``j``, its
scaled ``B`` transposed into ``b[j]`` ``[slots, R, out_j]`` (ranks below the maximum are
zero-padded, which adds exact zeros). For ``T`` rows ``x``, the step's one-hot
row-to-slot matrix ``m`` ``[T, slots]`` selects each row's slot:

    u = (x @ a.view(-1, in).T).view(T, slots, J, R) * m[:, :, None, None]
    y[:, out_j] = base(x)[:, out_j] + u[:, :, j].reshape(T, -1) @ b[j].view(-1, out_j)

one GEMM for every target's ``A`` and one per target for ``B``, over every row whatever
the mix of adapters (the segmented form of Punica's batched LoRA, Chen et al., "Punica:
Multi-Tenant LoRA Serving", MLSys 2024), so a step with several adapters runs one
forward. Each target's ``B`` is kept apart rather than placed in a block-diagonal
``[R * J, out]``: a step reads every adapter's matrices once, and the zeros of that block
would be read with them. Rows of the base model have an all-zero row in ``m``. Only the
slots up to the highest one used take part, and a target no slot's adapter adapts is
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter


@dataclass(slots=True)
class LoRAStep:
    """What every projection reads of the step being run."""

    onehot: torch.Tensor | None = None
    """``[T, slots used]``: row ``t`` is 1 at its request's slot; None: no adapter in the
    step (the projections add nothing)."""
    slots: frozenset[int] = field(default_factory=frozenset)
    """The slots of the step's adapters."""


@dataclass(frozen=True, slots=True)
class Target:
    """One projection inside a fused one: its name and its output columns."""

    name: str
    offset: int
    size: int


class LoRAProjection(nn.Module):
    """A decoder layer's projection plus the LoRA updates of the step's adapters.

    ``x`` ``[..., in]`` in, ``[..., out]`` out, as ``base``.
    """

    def __init__(
        self,
        base: nn.Module,
        layer: int,
        targets: tuple[Target, ...],
        in_features: int,
        num_slots: int,
        max_rank: int,
        step: LoRAStep,
    ) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.targets = targets
        self.in_features = in_features
        self.out_features = sum(t.size for t in targets)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.step = step
        self.a: torch.Tensor | None = None
        """``[slots, J, R, in]``, made when an adapter first targets this projection."""
        self.b: list[torch.Tensor | None] = [None] * len(targets)
        """Per target, ``[slots, R, out_j]``, made when an adapter first targets it."""
        self.filled: list[set[int]] = [set() for _ in targets]
        """Per target, the slots whose adapter adapts it."""

    def load_slot(self, slot: int, adapter: LoRAAdapter | None, device, dtype) -> None:
        """Put ``adapter``'s updates of this projection in ``slot`` (None: empty it)."""
        if any(slot in f for f in self.filled):
            self.a[slot].zero_()
            for j, f in enumerate(self.filled):
                if slot in f:
                    self.b[j][slot].zero_()
                    f.discard(slot)
        if adapter is None:
            return
        for j, t in enumerate(self.targets):
            w = adapter.weights.get((self.layer, t.name))
            if w is None:
                continue
            a, b = w
            if self.a is None:
                shape = (self.num_slots, len(self.targets), self.max_rank, self.in_features)
                self.a = torch.zeros(shape, device=device, dtype=dtype)
            if self.b[j] is None:
                shape = (self.num_slots, self.max_rank, t.size)
                self.b[j] = torch.zeros(shape, device=device, dtype=dtype)
            r = a.shape[0]
            self.a[slot, j, :r] = a.to(device, dtype)
            self.b[j][slot, :r] = b.T.to(device, dtype)
            self.filled[j].add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        st = self.step
        if st.onehot is None or self.a is None:
            return y
        live = [j for j, f in enumerate(self.filled) if f & st.slots]
        if not live:
            return y
        n = st.onehot.shape[1]
        _, num_targets, rank, width = self.a.shape
        x2 = x.reshape(-1, width)
        u = torch.mm(x2, self.a[:n].reshape(-1, width).T)
        u = u.view(-1, n, num_targets, rank) * st.onehot[:, :, None, None]
        y2 = y.view(-1, self.out_features)
        for j in live:
            t = self.targets[j]
            uj = u[:, :, j].reshape(-1, n * rank)
            y2[:, t.offset : t.offset + t.size].addmm_(uj, self.b[j][:n].reshape(n * rank, t.size))
        return y
