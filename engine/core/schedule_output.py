"""A step's plan, as the scheduler hands it to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: tokens ``[start, start + num_tokens)`` of its ids."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits sample."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class PrefillBudget:
    """A step's prefill tokens under the TPOT guard.

    ``total`` is what ``max_num_batched_tokens`` leaves after the decodes; ``capped`` is
    what any prompt may take (the guard's cap), ``owed`` what prompts owed their TTFT may
    take (:attr:`policies.slo_guard.GuardPlan.owed`); both at most ``total``.
    """

    total: int
    capped: int
    owed: int

    def take(self, n: int) -> None:
        self.total -= n
        self.capped = max(0, min(self.capped - n, self.total))
        self.owed = max(0, min(self.owed - n, self.total))


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``seqs`` holds the decodes (one token each) before the prefills."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decodes: int = 0
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> its block table, for every scheduled request."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
