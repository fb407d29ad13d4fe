"""OpenAI-compatible request bodies (pydantic), validated as vLLM's server validates them.

Only the request side is modelled: responses are plain dicts built in ``router.api``,
since they are written, never parsed. Every field is honoured or refused, never silently
ignored: an unknown field is a 400 naming it, a known OpenAI field this server does not
implement is a 400 saying so (``UNSUPPORTED``), unless its value asks for the default
behaviour; fields that change nothing about the output (``user``, ``metadata``, ``store``,
``service_tier``) are accepted.
"""

from __future__ import annotations

import json
import types
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOOL_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
}
"""The chat endpoint's tool-calling fields (:class:`ChatCompletionRequest`), which the
completions endpoint refuses."""

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    **TOOL_FIELDS,
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "logit_bias_type": (None,),
    "verbosity": (None, "medium"),
}
"""OpenAI fields this server does not implement -> the values that ask for nothing (and
are accepted as such)."""


CHAT_UNSUPPORTED = {
    **{k: v for k, v in UNSUPPORTED.items() if k not in TOOL_FIELDS},
    "echo": (None, False),
}
"""Chat requests take the tool fields, and refuse ``echo`` (a completions field) and the
deprecated ``functions``/``function_call`` (``tools``/``tool_choice`` replace them)."""


def unsupported_field(
    body: dict[str, Any], table: dict[str, tuple[Any, ...]] = UNSUPPORTED
) -> str | None:
    """The first field of ``body`` in ``table`` (see :data:`UNSUPPORTED`) set to ask for
    something; None when there is none."""
    return next((k for k, neutral in table.items() if k in body and body[k] not in neutral), None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send one last chunk with the usage and empty ``choices``."""
    include_obfuscation: bool | None = None
    """Accepted; no obfuscation padding is added (it only guards against side channels)."""


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    """Accepted: the output always follows the schema here (as OpenAI's strict mode)."""


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("`json_schema` is required with type json_schema, and only then")
        return self

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow; None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema else None


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; ranges as OpenAI (and vLLM, for its extensions)
    document them."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    """Output tokens at most; null means unset (completions: 16; chat: up to the context)."""
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    """A signed 64-bit integer, as vLLM's API."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    """JSON output: ``json_object`` (any object) or ``json_schema`` (validates against it)."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, OpenAI's form) -> bias in [-100, 100] added to its logit."""
    user: str | None = None
    """Accepted; changes nothing (OpenAI uses it for abuse monitoring)."""
    metadata: dict[str, Any] | None = None
    """Accepted; changes nothing."""
    store: bool | None = None
    """Accepted; nothing is stored."""
    service_tier: str | None = None
    """Accepted; there is one tier here (traffic classes come from the API key)."""
    safety_identifier: str | None = None
    """Accepted; changes nothing (OpenAI's successor of ``user``)."""
    prompt_cache_key: str | None = None
    """Accepted; changes nothing (the prefix cache and prefix-affinity routing work
    from the prompt's tokens)."""
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1)
    """-1, 0 or null: no top-k cut."""
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it)."""
    priority: int | None = None
    """iterserve's (and vLLM's) extension: lower is more urgent; may only lower urgency."""

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if (name := unsupported_field(data, cls.unsupported)) is not None:
            raise ValueError(f"`{name}` is not supported by this server")
        # null asks for the default (as OpenAI's API), where null is not a value itself
        return {
            k: v
            for k, v in data.items()
            if k not in cls.unsupported and not (v is None and _default_for_null(cls, k))
        }

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` can only be set when `stream` is true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v: dict[str, float] | None) -> dict[int, float]:
        out = {}
        for key, bias in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
            out[int(key)] = bias
        return out


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    """Text, token ids, or a list of texts or of token-id lists (one choice set each)."""
    max_tokens: int | None = Field(16, ge=0)
    """16 when absent, as OpenAI's completions; null: up to the context; 0 only with
    ``echo`` (scoring a prompt)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Top log-probabilities per output token (0: only the sampled token's); with
    ``echo``, per prompt token too."""
    echo: bool = False
    """Return the prompt before the completion (and its log-probabilities with
    ``logprobs``)."""

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> list[str | list[int]]:
        return _prompt_list(v, "prompt")


def _prompt_list(v: Any, name: str) -> list[str | list[int]]:
    """A text, token ids, or a list of either, as a list of prompts.

    Raises:
        ValueError: no prompt, an empty one, or a number that is not a token id.
    """
    many = isinstance(v, list) and bool(v) and isinstance(v[0], str | list)
    prompts = list(v) if many else [v]
    if not prompts or any(not p for p in prompts):
        raise ValueError(f"{name} is empty")
    for p in prompts:
        if not isinstance(p, str) and not all(0 <= t < 2**31 for t in p):
            bad = next(t for t in p if not 0 <= t < 2**31)
            raise ValueError(f"{bad} is not a token id")
    return prompts


def _default_for_null(model: type[BaseModel], name: str) -> bool:
    """Whether ``name`` is a field of ``model`` that has a default and cannot be null."""
    field = model.model_fields.get(name)
    return (
        field is not None
        and not field.is_required()
        and types.NoneType not in get_args(field.annotation)
    )


MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "name": (None, ""),
    "function_call": (None,),
    "refusal": (None,),
    "annotations": (None, []),
    "audio": (None,),
}
"""Message fields OpenAI defines that this server does not use: accepted only empty (as
clients echo a previous response's message back), refused when set."""

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for a function's name."""


class FunctionDefinition(BaseModel):
    """A function the model may call: OpenAI's ``tools[].function``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    """Shown to the model in the prompt (the chat template renders it)."""
    parameters: dict[str, Any] | None = None
    """The JSON schema of the arguments, an object; absent: no arguments (``{}``)."""
    strict: bool | None = None
    """Accepted: a call's arguments always follow ``parameters`` here."""

    @field_validator("parameters")
    @classmethod
    def _a_schema_of_an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(v)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "the root"
            raise ValueError(f"not a valid JSON schema (at {where}): {e.message}") from None
        if v.get("type", "object") != "object":
            raise ValueError(f"the arguments' schema must be of type object, not {v['type']!r}")
        return v


class FunctionTool(BaseModel):
    """OpenAI's ``tools[]`` entry: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this one."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str
    """The arguments as a JSON text (OpenAI's form), an object."""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            parsed = json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object")
        return v


class ToolCall(BaseModel):
    """A call an assistant message made (OpenAI's ``messages[].tool_calls[]``), as a
    response returned it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant's calls; rendered by the chat template."""
    tool_call_id: str | None = None
    """A ``tool`` message's answer to this call id."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if (name := unsupported_field(data, MESSAGE_NEUTRAL)) is not None:
            raise ValueError(f"`{name}` in messages is not supported by this server")
        return {k: v for k, v in data.items() if k not in MESSAGE_NEUTRAL}

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        # Only an assistant turn may come without content (OpenAI's rule: with tool calls
        # or a refusal instead); any other role's missing content is a client's mistake.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a {self.role} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"`tool_calls` is for assistant messages, not {self.role}")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs `tool_call_id`, and only a tool message")
        return self

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"content part of type {part.get('type')!r} is not supported (text only)"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """The newer name of ``max_tokens``; it wins when both are set."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[FunctionTool] | None = None
    """Functions the model may call (:mod:`router.tools`)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """``none``: text only; ``auto`` (the default with ``tools``): text or calls;
    ``required``: one call or more; a named function: one call to it."""
    parallel_tool_calls: bool = True
    """Whether the model may make more than one call in a response."""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("`top_logprobs` can only be set when `logprobs` is true")
        return self

    @field_validator("tools")
    @classmethod
    def _names_unique(cls, v: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"function {twice!r} is defined twice")
        return v


ApiRequest = CompletionRequest | ChatCompletionRequest
"""A validated request body of either endpoint."""


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: one vector per input (see
    :class:`engine.core.params.PoolingParams`)."""

    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: str
    input: str | list[int] | list[str] | list[list[int]]
    """A text, token ids, or a list of texts or of token-id lists: one vector each, in
    order."""
    encoding_format: Literal["float", "base64"] = "float"
    """``float``: each vector a list of numbers; ``base64``: its little-endian float32
    bytes, base64-encoded (the ``openai`` client's default)."""
    dimensions: int | None = Field(None, ge=1)
    """Cut each vector to its first ``dimensions`` components, then normalize: only a
    size the server's ``embedding_dimensions`` lists (a Matryoshka-trained model's), or
    the full size."""
    user: str | None = None
    """Accepted; changes nothing (OpenAI uses it for abuse monitoring)."""
    priority: int | None = None
    """iterserve's (and vLLM's) extension: lower is more urgent; may only lower urgency."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # null asks for the default (as OpenAI's API), where null is not a value itself
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (v is None and _default_for_null(cls, k))}

    @field_validator("input")
    @classmethod
    def _inputs(cls, v: Any) -> list[str | list[int]]:
        return _prompt_list(v, "input")


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    lora_name: str = Field(min_length=1, description="the name requests give as `model`")
    lora_path: str = Field(
        min_length=1, description="the PEFT directory, readable by every replica"
    )


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}

    lora_name: str = Field(min_length=1)
