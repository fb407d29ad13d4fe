"""One replica's load as the router sees it: the wire format between replica and router.

Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.step_time import DEFAULT_STEP_COEFFICIENTS, predict_step


@dataclass(kw_only=True)
class LoadSnapshot:
    """One replica's load, as the router sees it. Plain JSON types via :meth:`to_dict`.

    Per-class dicts map a traffic class name to a count; a missing class counts 0.
    """

    max_num_batched_tokens: int
    """The token budget of one step."""
    max_num_seqs: int
    """Running requests at most."""
    num_kv_blocks_free: int
    block_size: int = 16
    """Tokens per KV block."""
    waiting_prefill_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens still to compute: each waiting request's (preempted ones: prompt and
    output so far) less what the prefix cache holds of it, plus the remaining chunks of
    running requests still prefilling."""
    running_seqs: dict[str, int] = field(default_factory=dict)
    waiting_requests: dict[str, int] = field(default_factory=dict)
    """Requests queued for the replica (its waiting queue, plus any the router holds)."""
    kv_blocks_used: dict[str, int] = field(default_factory=dict)
    """KV blocks held by each class's running requests (optional: lets admission count
    blocks that the priority policy can reclaim from less urgent classes)."""
    kv_usage: float = 0.0
    """Fraction of the KV cache in use, 0..1 (cached blocks no request holds are free)."""
    prefix_cache_hit_rate: float = 0.0
    """Prompt tokens found in the prefix cache over tokens looked up, since start, 0..1."""
    num_cached_blocks: int = 0
    """KV blocks holding a cached prefix, held or free."""
    step_coefficients: tuple[float, float, float] = DEFAULT_STEP_COEFFICIENTS
    """The replica's :meth:`StepTimeModel.coefficients`."""
    step_fit_warm: bool = False
    """The replica's :attr:`StepTimeModel.warm`: its fit's window of steps is full."""
    tpot_slo_guard: bool = False
    """The replica sheds less urgent decodes to hold the tightest TPOT SLO running."""
    tpot_slo_guard_target: float = 1.0
    """The guard holds the predicted step time at this fraction of that SLO."""
    owed_step_s: float = 0.0
    """The longest step, in the step-time model's seconds, that the TPOT guard would run
    now for a prompt it owes its TTFT SLO (``GuardPlan.lent_s`` of the last step: the
    running decodes' banked TPOT credit and part of their later headroom); 0 when no
    running decode has a TPOT SLO or the guard is off."""
    recent_step_s: float = 0.0
    """Mean wall time of the replica's last few steps, seconds; 0 when it is idle."""
    step_left_s: float = 0.0
    """Seconds the step in flight is predicted to run on after ``timestamp``; 0 when none
    is. While a step runs, the queues, running counts and KV blocks are as after it: its
    prefill chunks count as done, so a request that arrives meanwhile waits for what is
    left of that step, not for the work in it again."""
    timestamp: float = 0.0
    """When the snapshot was taken, seconds since the epoch (``time.time()``: it crosses
    processes, so not a monotonic clock)."""
    loras: tuple[str, ...] = ()
    """The LoRA adapters the replica holds in host memory: a request for another one reads
    it from disk first."""
    lora_load_s: float = 0.0
    """Mean seconds the replica's reads of an adapter from disk took (0: none yet)."""

    def step_time(self, prefill_tokens: float, decode_seqs: float) -> float:
        """Predicted seconds of one step on this replica."""
        return predict_step(self.step_coefficients, prefill_tokens, decode_seqs)

    def with_queued(self, queued: Iterable[tuple[str, int]]) -> LoadSnapshot:
        """A copy with more requests waiting: one per ``(traffic class, prompt tokens)``.

        Requests that reached (or are on their way to) the replica after the snapshot was
        taken; the snapshot itself is left unchanged."""
        totals: dict[str, tuple[int, int]] = {}
        for cls, n in queued:
            count, tokens = totals.get(cls, (0, 0))
            totals[cls] = (count + 1, tokens + n)
        return self.with_queued_totals(totals)

    def with_queued_totals(self, totals: Mapping[str, tuple[int, int]]) -> LoadSnapshot:
        """A copy with, per traffic class, ``(requests, prompt tokens)`` more waiting."""
        if not totals:
            return self
        waiting, tokens = dict(self.waiting_requests), dict(self.waiting_prefill_tokens)
        for cls, (count, n) in totals.items():
            waiting[cls] = waiting.get(cls, 0) + count
            tokens[cls] = tokens.get(cls, 0) + n
        # A shallow copy of the fields, not dataclasses.replace (which re-runs __init__):
        # admission re-decides held requests against every replica many times a second.
        out = object.__new__(LoadSnapshot)
        out.__dict__.update(self.__dict__, waiting_requests=waiting, waiting_prefill_tokens=tokens)
        return out

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks the replica holds: the free ones and those its requests use (as far as
        ``kv_blocks_used`` reports them)."""
        return self.num_kv_blocks_free + sum(self.kv_blocks_used.values())

    @property
    def total_running(self) -> int:
        return sum(self.running_seqs.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (lists for tuples, fresh dicts)."""
        d = dataclasses.asdict(self)
        d["step_coefficients"] = list(self.step_coefficients)
        d["loras"] = list(self.loras)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadSnapshot:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (a newer replica's extras).

        Raises:
            TypeError: a required key is missing.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        for k in ("waiting_prefill_tokens", "running_seqs", "waiting_requests", "kv_blocks_used"):
            if k in kwargs:
                kwargs[k] = {str(name): int(n) for name, n in kwargs[k].items()}
        if "step_coefficients" in kwargs:
            a, b, c = kwargs["step_coefficients"]
            kwargs["step_coefficients"] = (float(a), float(b), float(c))
        if "loras" in kwargs:
            kwargs["loras"] = tuple(str(name) for name in kwargs["loras"])
        return cls(**kwargs)
