"""OpenAI-compatible request bodies (pydantic), validated as vLLM's server validates them.

Only the request side is modelled: responses are plain dicts built in ``router.api``,
since they are written, never parsed. Unknown fields are ignored, as OpenAI clients send
fields a server may not use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """Send one last chunk with the usage and empty ``choices``."""


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; ranges as OpenAI documents them."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    """Output tokens at most; null means unset (completions: 16; chat: up to the context)."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past EOS (benchmarks use it)."""
    priority: int | None = None
    """iterserve's (and vLLM's) extension: lower is more urgent; may only lower urgency."""

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        return stops


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str]
    """Text, token ids, or a list holding one text (one prompt per request)."""
    max_tokens: int | None = Field(16, ge=1)
    """16 when absent, as OpenAI's completions; null: up to the context."""
    logprobs: int | None = Field(None, ge=0, le=20)
    """Top log-probabilities per output token (0: only the sampled token's)."""

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (got a list of "
                                 f"{len(v)}); send one request each")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r} is not "
                                 "supported (text only)")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """The newer name of ``max_tokens``; it wins when both are set."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
