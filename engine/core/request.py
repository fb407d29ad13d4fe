"""Request state, sampling parameters and the outputs handed back to callers."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from policies.priority import DEFAULT_CLASS

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily, as vLLM's ``_SAMPLING_EPS``: the limit of
sampling as the temperature goes to 0 is the argmax, and dividing logits by a temperature
near fp32's smallest normal overflows them to inf (the softmax is then NaN)."""


class RequestOutputKind(enum.Enum):
    """What each :class:`RequestOutput` of a request carries (vLLM's ``RequestOutputKind``).

    ``CUMULATIVE``: an output every step with the text, token ids and logprobs so far.
    ``DELTA``: an output every step with only what that step added (streaming: nothing
    is copied twice). ``FINAL_ONLY``: one output, when the request finishes, with all of it.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class ParamError(ValueError):
    """A request parameter out of range or not servable here; ``param`` names the field
    (the OpenAI API's name for it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Raises:
        ParamError: a field is out of range; the message names the field and value.
    """

    max_tokens: int | None = 16
    """Output tokens at most; None: until EOS or the end of the context."""
    temperature: float = 1.0
    """Under :data:`GREEDY_TEMPERATURE` (0 included) means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k cut."""
    min_p: float = 0.0
    """Drop tokens whose probability is under ``min_p`` times the top token's (after
    temperature; Nguyen et al., 2024, as vLLM's ``min_p``)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit per time it is already in the output (OpenAI's)."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output
    (Keskar et al., 2019, CTRL; as transformers and vLLM)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> added to its logit, in [-100, 100] (OpenAI's)."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` are masked, and stop strings not checked, until the
    output has this many tokens."""
    json_schema: dict[str, Any] | None = None
    """Constrain the output to JSON that validates against this schema (``{"type":
    "object"}``: any JSON object, OpenAI's ``json_object``); see :mod:`engine.model.structured`."""
    seed: int | None = None
    """A signed 64-bit integer (``torch.Generator.manual_seed``'s range, as vLLM's API)."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    """Top-k log-probabilities to return per output token (the sampled one always too)."""
    prompt_logprobs: int | None = None
    """Top-k log-probabilities per prompt token (the prompt's own always too; the first
    token has none), for scoring; in :attr:`RequestOutput.prompt_logprobs`."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each output carries; :class:`engine.LLM` always asks for ``FINAL_ONLY``."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        for name, value, ok, rule in self._checks():
            if not ok:
                raise ParamError(name, f"SamplingParams.{name}={value!r}: {rule}")

    def _checks(self) -> list[tuple[str, Any, bool, str]]:
        finite = math.isfinite
        return [
            (
                "max_tokens",
                self.max_tokens,
                self.max_tokens is None or self.max_tokens >= 1,
                "must be >= 1 or None",
            ),
            (
                "temperature",
                self.temperature,
                finite(self.temperature) and self.temperature >= 0,
                "must be >= 0",
            ),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "must be in (0, 1]"),
            (
                "seed",
                self.seed,
                self.seed is None or -(2**63) <= self.seed < 2**63,
                "must be a signed 64-bit integer",
            ),
            ("top_k", self.top_k, self.top_k == -1 or self.top_k >= 0, "must be -1, 0 or >= 1"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "must be in [0, 1]"),
            (
                "presence_penalty",
                self.presence_penalty,
                -2 <= self.presence_penalty <= 2,
                "must be in [-2, 2]",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                -2 <= self.frequency_penalty <= 2,
                "must be in [-2, 2]",
            ),
            (
                "repetition_penalty",
                self.repetition_penalty,
                finite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be > 0",
            ),
            (
                "logit_bias",
                self.logit_bias,
                all(-100 <= v <= 100 for v in self.logit_bias.values()),
                "biases must be in [-100, 100]",
            ),
            (
                "min_tokens",
                self.min_tokens,
                self.min_tokens >= 0
                and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
                "must be >= 0 and <= max_tokens",
            ),
            (
                "json_schema",
                self.json_schema,
                self.json_schema is None
                or (isinstance(self.json_schema, dict) and not self.ignore_eos),
                "must be a JSON schema object, and cannot be combined with ignore_eos",
            ),
            ("n", self.n, self.n >= 1, "must be >= 1"),
            (
                "logprobs",
                self.logprobs,
                self.logprobs is None or self.logprobs >= 0,
                "must be >= 0 or None",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs,
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "must be >= 0 or None",
            ),
            (
                "stop",
                self.stop,
                all(isinstance(s, str) and s for s in self.stop),
                "must be non-empty strings",
            ),
        ]

    @property
    def penalized(self) -> bool:
        """Whether any logits processor applies (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


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
    """Its xgrammar matcher when it has a ``json_schema`` (:mod:`engine.model.structured`)."""
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
    error: str | None = None
    """Set on the last output (``finished``, finish reason ``error``) of a request that
    failed inside the engine: the exception's type and message. Other requests go on."""
