"""What a request asks of the engine: its sampling parameters (or, for an embedding, its
pooling parameters), and how its outputs are shaped.

Torch-free (standard library only): the router builds :class:`SamplingParams` (or
:class:`PoolingParams`) once per request, checked at construction, and hands it to a
replica as is (pickled on the Ray path; unpickling runs no check again).
``tests/test_request_params.py`` checks that importing the router leaves torch out.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

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


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A request's LoRA adapter (vLLM's ``LoRARequest``, without its integer id): a PEFT
    directory (``adapter_config.json`` and ``adapter_model.safetensors``) that every
    replica can read. An engine loads it on first use and keeps it by ``name``
    (:class:`engine.lora.LoRAManager`)."""

    name: str
    """The adapter's name, as clients choose it in ``model``."""
    path: str
    """The adapter's directory."""


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request (vLLM's ``PoolingParams``): a prefill-only request whose
    result is one vector, the final hidden states of its prompt (after the model's last
    norm) pooled as the engine's ``embedding_pooling`` says (``last``: the last token's;
    ``mean``: the mean over the prompt's tokens), cut to ``dimensions`` components and
    L2-normalized, in fp32 (:attr:`engine.core.request.RequestOutput.embedding`).

    Raises:
        ParamError: ``dimensions`` under 1.
    """

    dimensions: int | None = None
    """Keep the first ``dimensions`` components, then normalize (a Matryoshka-trained
    model's truncation); None: all of the hidden size. The engine serves only the sizes
    its ``embedding_dimensions`` lists, and the full hidden size."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ParamError(
                "dimensions", f"PoolingParams.dimensions={self.dimensions!r}: must be >= 1"
            )


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
    structural_tag: dict[str, Any] | None = None
    """Constrain the output to an xgrammar structural tag (``{"type": "structural_tag",
    "format": {...}}``, JSON-able): free text with tagged, schema-checked spans, as tool
    calls are (:mod:`router.tools` builds them); errors name ``tools``."""
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
            (
                "structural_tag",
                self.structural_tag,
                self.structural_tag is None
                or (
                    isinstance(self.structural_tag, dict)
                    and self.json_schema is None
                    and not self.ignore_eos
                ),
                "must be a structural tag object, and cannot be combined with json_schema "
                "or ignore_eos",
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

    # Pickled as the values alone, in field order, the output kind as its string: a
    # slotted object's default state names every field, and an enum member costs a second
    # class reference. Unpickling runs no check again (bench/request_pickle.py).
    def __getstate__(self) -> tuple[Any, ...]:
        return (*_other_values(self), self.output_kind.value)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        *values, kind = state
        for set_slot, value in zip(_SET_OTHERS, values, strict=True):
            set_slot(self, value)
        self.output_kind = _KIND_OF[kind]


_OTHER_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name != "output_kind")
_other_values = attrgetter(*_OTHER_FIELDS)
_SET_OTHERS = tuple(getattr(SamplingParams, name).__set__ for name in _OTHER_FIELDS)
"""Each field's slot setter but ``output_kind``'s, in field order."""
_KIND_OF = {kind.value: kind for kind in RequestOutputKind}
