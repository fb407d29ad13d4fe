"""The engine's seams: what a model runner provides, and what each step reports.

:class:`engine.LLMEngine` takes a runner, a tokenizer, a scheduler and a clock; a fake
runner that advances a fake clock by a cost model runs the whole scheduling path with no
model and no wall clock (``tests/test_engine_seams.py``), as the simulator will.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.schedule_output import SchedulerOutput


@dataclass(slots=True)
class SampleResult:
    """One sampled token; ``logprobs`` maps token id -> log-probability (None if not asked)."""

    token_id: int
    logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class PooledResult:
    """An embedding request's result (:class:`engine.core.params.PoolingParams`): its
    pooled final hidden state, cut to the asked dimensions and L2-normalized, in fp32
    (as Python floats, which hold fp32 values exactly)."""

    embedding: list[float]


StepResult = SampleResult | PooledResult
"""What :meth:`ModelRunner.execute` returns for one request whose chunk reached its last
token: a sampled token, or (an embedding request) its pooled vector."""


class ModelRunner(Protocol):
    """Runs scheduled steps and samples them (:class:`engine.model.runner.TorchModelRunner`).

    Optional, outside the protocol: ``last_phases``, the runner's own breakdown of its
    last :meth:`execute` as ``((phase name, seconds), ...)`` (``TorchModelRunner``:
    prepare, forward, sample, on ``time.perf_counter``). The engine copies it into
    :attr:`StepRecord.phases` when the runner has it (``getattr(runner, "last_phases",
    ())``), so a fake runner need not. ``lora``, the runner's LoRA adapters
    (:class:`engine.lora.LoRAManager`, or anything with its ``get(lora)`` returning an
    object with a ``key``, ``remove``, ``loaded`` and ``mean_load_s``:
    ``deploy.sim.runner.SimLoRAs``); absent or None: the runner serves no adapter.
    """

    num_kv_blocks: int
    """KV blocks its cache holds (of the config's ``block_size`` tokens)."""
    max_model_len: int
    """Tokens of context a sequence may use (prompt plus output)."""
    vocab_size: int
    eos_token_ids: Collection[int]

    def execute(self, out: SchedulerOutput) -> dict[str, StepResult]:
        """Run one step; the sampled token (and logprobs) of each request, by id, whose
        scheduled chunk reached its last token (``ScheduledSeq.samples``); for an
        embedding request (``Request.pooling``) its :class:`PooledResult` instead."""
        ...


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One executed step, as each of :attr:`engine.LLMEngine.step_listeners` receives it.

    Times are seconds. ``start``, ``seconds`` (the whole step: schedule, execute,
    detokenize, outputs) and ``schedule_s`` (the part in ``scheduler.schedule()``) are on
    the engine's clock. ``phases`` is the runner's own breakdown of its ``execute`` call,
    ``((name, seconds), ...)`` in the order run, on the runner's timer
    (``TorchModelRunner``: ``prepare``, ``forward``, ``sample`` on ``time.perf_counter``;
    on CUDA the forward's time is its launches' and the wait for the logits falls in
    ``sample``); empty when the runner gives none (see :class:`ModelRunner`).
    ``predicted_s`` is the step-time model's prediction for the step's shape, made before
    it ran and scaled by the model's recent measured / predicted ratio (as the TPOT guard
    sees it). ``tokens_at`` is when the step's sampled tokens were stamped (a request's
    first-token time), in seconds from ``start``. Queue sizes are after the step.
    ``seqs`` holds ``(request id, first position scheduled, tokens)`` per scheduled
    sequence, decodes first; ``guard`` is the TPOT guard's plan (defaults when it is off).
    """

    index: int
    start: float
    seconds: float
    schedule_s: float
    tokens_at: float
    phases: tuple[tuple[str, float], ...]
    predicted_s: float
    num_decodes: int
    num_prefill_tokens: int
    num_waiting: int
    num_running: int
    seqs: tuple[tuple[str, int, int], ...]
    preempted: tuple[str, ...]
    prefill_cap: float
    owed_cap: float
    sat_out: tuple[str, ...]
    shed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FinishRecord:
    """One request that ended (finished, stopped or aborted), as
    :attr:`engine.LLMEngine.on_finish` receives it.

    Times are seconds on the engine's clock: ``arrival`` (added to the engine),
    ``first_token`` (its first token stamped; None if it got none) and ``finish``.
    ``output_tokens`` is the most any of its ``n`` sequences generated; ``reason`` is
    the first sequence's finish reason (``stop``, ``length`` or ``abort``).
    """

    request_id: str
    traffic_class: str
    priority: int
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    arrival: float
    first_token: float | None
    finish: float
    reason: str
