"""Many LoRA adapters in one step: each projection applies every row's own adapter in
one batched pass on top of the base projection.

The adapters active in a step sit in slots (``max_loras`` of them). A fused projection
(q, k and v side by side, or gate and up) keeps, per slot, its targets' ``A`` stacked into
``a`` ``[slots, K, in]`` and their scaled ``B`` transposed into ``b`` ``[slots, K, out]``,
each target's ``B`` in its own output columns and rows, with ``K = targets * max_rank``
(ranks below the maximum are zero-padded, which adds exact zeros). For ``T`` rows ``x``,
the step's one-hot row-to-slot matrix ``m`` ``[T, slots]`` selects each row's slot:

    y = base(x) + ((x @ a.view(-1, in).T).view(T, slots, K) * m[..., None]).view(T, -1)
                  @ b.view(-1, out)

two GEMMs over every row whatever the mix of adapters (the segmented form of Punica's
batched LoRA, Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024), so a step
with several adapters runs one forward. Rows of the base model have an all-zero row in
``m``. Only the slots up to the highest one used take part.
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
        """``[slots, K, in]``, made when an adapter first targets this projection."""
        self.b: torch.Tensor | None = None
        """``[slots, K, out]``."""
        self.filled: set[int] = set()
        """Slots whose adapter targets this projection."""

    def load_slot(self, slot: int, adapter: LoRAAdapter | None, device, dtype) -> None:
        """Put ``adapter``'s updates of this projection in ``slot`` (None: empty it)."""
        if slot in self.filled:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.filled.discard(slot)
        if adapter is None:
            return
        mine = [
            (j, t, adapter.weights.get((self.layer, t.name))) for j, t in enumerate(self.targets)
        ]
        mine = [(j, t, w) for j, t, w in mine if w is not None]
        if not mine:
            return
        if self.a is None:
            k = len(self.targets) * self.max_rank
            self.a = torch.zeros(self.num_slots, k, self.in_features, device=device, dtype=dtype)
            self.b = torch.zeros(self.num_slots, k, self.out_features, device=device, dtype=dtype)
        r0 = self.max_rank
        for j, t, (a, b) in mine:
            r = a.shape[0]
            self.a[slot, j * r0 : j * r0 + r] = a.to(device, dtype)
            self.b[slot, j * r0 : j * r0 + r, t.offset : t.offset + t.size] = b.T.to(device, dtype)
        self.filled.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        st = self.step
        if st.onehot is None or self.a is None or not (self.filled & st.slots):
            return y
        n = st.onehot.shape[1]
        k = self.a.shape[1]
        x2 = x.reshape(-1, self.in_features)
        u = torch.mm(x2, self.a[:n].reshape(n * k, self.in_features).T)
        u = (u.view(-1, n, k) * st.onehot[:, :, None]).view(-1, n * k)
        y2 = y.view(-1, self.out_features)
        y2.addmm_(u, self.b[:n].reshape(n * k, self.out_features))
        return y
