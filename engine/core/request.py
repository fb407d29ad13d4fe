"""Request state inside the engine and the outputs handed back to callers (the sampling
parameters: :mod:`engine.core.params`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from engine.core.params import LoRARequest, PoolingParams, SamplingParams
from policies.priority import DEFAULT_CLASS


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request that :meth:`engine.LLMEngine.check` found servable: what
    :meth:`engine.LLMEngine.add_checked` builds its sequences from, checking nothing again."""

    prompt_text: str | None
    """The prompt as text, when it came as text."""
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    """:class:`PoolingParams` for an embedding request (prefill only, no output tokens)."""
    traffic_class: str
    max_tokens: int
    """Output tokens at most, after clamping ``params.max_tokens`` to the context (0 for
    an embedding request)."""
    resume_token_ids: tuple[int, ...] = ()
    """Output the request already produced elsewhere (see ``LLMEngine.add_request``)."""
    lora: LoRARequest | None = None
    """Its LoRA adapter; None: the base model."""
    lora_key: bytes = b""
    """The adapter's weights' identity (``engine.lora.LoRAAdapter.key``), for the prefix
    cache."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    """An exception while running the request's step (:attr:`RequestOutput.error`)."""


@dataclass(slots=True, eq=False)
class Request:
    """One sequence's state inside the engine.

    Lifecycle: WAITING -> RUNNING (prefill in chunks, then decode) -> FINISHED.
    Preemption by recompute sends a RUNNING request back to WAITING with
    ``num_computed_tokens = 0``; its output tokens are kept and re-prefilled with the
    prompt. ``arrival_time`` never changes, so a preempted request keeps its place.

    Invariant: the KV cache holds exactly the first ``num_computed_tokens`` of
    ``token_ids`` (prompt then output), in the blocks of its block table.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    """Seconds, on the engine's clock."""
    max_tokens: int
    """Output tokens at most, after clamping max_tokens=None to the context."""
    priority: int = 0
    traffic_class: str = DEFAULT_CLASS
    ttft_slo_s: float = math.inf
    """The traffic class's TTFT SLO in seconds (read by the scheduler's TPOT guard)."""
    tpot_slo_s: float = math.inf
    """The traffic class's TPOT SLO in seconds (read by the scheduler's TPOT guard)."""
    parent_id: str | None = None
    """The caller's request id when ``n > 1`` fans out into several sequences."""
    lora: LoRARequest | None = None
    """Its LoRA adapter; None: the base model."""
    lora_key: bytes = b""
    """Salts its prefix-cache block hashes: one prompt under two adapters has two KV."""
    pooling: PoolingParams | None = None
    """Set for an embedding request: its prompt is prefilled, it samples no token, and
    the step that computes its last prompt token returns its pooled vector, which ends it
    (finish reason ``stop``; :attr:`embedding`). ``params`` are then unused defaults."""
    embedding: list[float] | None = None
    """An embedding request's vector (:class:`PoolingParams`), once its prompt is done."""
    index: int = 0
    """This sequence's place among the ``n`` of its parent."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV the prefix cache supplied at the first admission."""
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    """When the scheduler first admitted it to a step (queue time ends here)."""
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """Per prompt token when asked (``[None]`` until the prefill fills it; the first
    sequence of a group only): the runner appends one entry per prompt position."""
    generator: Any = None
    """The request's own ``torch.Generator`` when it has a seed (made on first use)."""
    grammar: Any = None
    """Its xgrammar matcher when it has a ``json_schema`` or a ``structural_tag``
    (:mod:`engine.model.structured`)."""
    detokenizer: Any = None
    error: Exception | None = None
    """What one of its per-request hooks raised in the step being run (a logits processor
    or its grammar, in the sampler); the engine fails the request when the step ends."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def mark_scheduled(self, now: float) -> None:
        """Admitted to a step at ``now``; the first time ends its queue time."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet computed: 1 while decoding, more while prefilling."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` sequences of a request.

    ``text``, ``token_ids`` and ``logprobs`` (one ``{token id: log-probability}`` per
    token, None when not asked for) are what the request's
    :attr:`SamplingParams.output_kind` says: all so far, or only this step's.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps in seconds on the engine's clock (``time.monotonic`` by default)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """One entry per prompt token (None for the first) when ``prompt_logprobs`` was
    asked for; a ``DELTA`` request gets it once, with its first output."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (OpenAI's ``cached_tokens``)."""
    embedding: list[float] | None = None
    """An embedding request's vector (:class:`engine.core.params.PoolingParams`: pooled,
    cut to its ``dimensions``, L2-normalized), on its last output; None otherwise."""
    error: str | None = None
    """Set on the last output (``finished``, finish reason ``error``) of a request that
    failed inside the engine: the exception's type and message. Other requests go on."""
