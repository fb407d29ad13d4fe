"""Tool calling in ``/v1/chat/completions``: what a request's ``tools`` and
``tool_choice`` ask of the engine, and which chat template renders them.

- **The grammar.** ``auto`` lets the model write text, and once it starts a call (the
  format's trigger, ``<tool_call>`` for Hermes) the rest of the call is constrained: a
  function among ``tools``, arguments valid against its schema. ``required`` allows only
  calls (at least one), a named function exactly one call to it. ``parallel_tool_calls:
  false`` allows at most one call. The grammar is an xgrammar structural tag
  (:meth:`router.tool_parsers.ToolCallFormat.structural_tag`) carried in
  ``SamplingParams.structural_tag``; the engine compiles it as it compiles a
  ``response_format`` schema.
- **The template.** A configured ``chat_template`` renders every chat request. Otherwise
  the model's own renders it when it takes ``tools`` (transformers'
  ``apply_chat_template(tools=...)``), and the shipped Hermes template
  (``router/templates/hermes_tools.jinja``) renders requests with tools, or with
  messages that carry calls or tool answers, when the model's template has no tool
  support (SmolLM2's has none). With ``tool_choice: none`` the tools are not rendered.
- **The answer** is read back by the format's parser (:mod:`router.tool_parsers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.errors import ApiError
from router.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice
from router.tool_parsers import PARSERS, ToolCallFormat, ToolMode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments' schema of a function given without ``parameters``: none, as OpenAI
defines such a function ("an empty parameter list")."""


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request may call tools (none when its ``tool_choice`` is ``none``)."""

    format: ToolCallFormat
    mode: ToolMode
    functions: tuple[tuple[str, dict[str, Any]], ...]
    """``(name, arguments' schema)`` of each function it may call (``named``: one)."""
    parallel: bool

    def structural_tag(self) -> dict[str, Any]:
        """The grammar of its output (``SamplingParams.structural_tag``)."""
        return self.format.structural_tag(list(self.functions), self.mode, self.parallel)


def tool_use(req: ChatCompletionRequest, parser: str) -> ToolUse | None:
    """The request's tool use; None when it calls no tools (no ``tools``, or
    ``tool_choice: none``).

    Raises:
        ApiError: 400 naming ``tool_choice`` when it asks for calls without ``tools`` or
            names a function not in them, and naming ``tools`` when ``response_format``
            also constrains the output.
    """
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    names = [t.function.name for t in tools]
    if not tools:
        raise ApiError(
            400,
            f"tool_choice: {_choice_text(choice)} needs `tools`",
            param="tool_choice",
            code="invalid_value",
        )
    if req.response_format is not None and req.response_format.output_schema() is not None:
        raise ApiError(
            400,
            "tools: cannot be combined with `response_format` unless `tool_choice` is none "
            "(both constrain the output)",
            param="tools",
            code="invalid_value",
        )
    functions = [(t.function.name, t.function.parameters or NO_ARGUMENTS) for t in tools]
    mode: ToolMode = "auto" if choice == "auto" else "required"
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        if wanted not in names:
            raise ApiError(
                400,
                f"tool_choice: function {wanted!r} is not in `tools` ({', '.join(names)})",
                param="tool_choice",
                code="invalid_value",
            )
        mode = "named"
        functions = [f for f in functions if f[0] == wanted]
    return ToolUse(PARSERS[parser], mode, tuple(functions), req.parallel_tool_calls)


def _choice_text(choice: Any) -> str:
    return choice if isinstance(choice, str) else f"function {choice.function.name!r}"


@cache
def shipped_template() -> str:
    """The shipped tool-aware ChatML template (Hermes' tool format)."""
    return resources.files("router").joinpath("templates/hermes_tools.jinja").read_text()


def read_template(value: str) -> str:
    """``chat_template`` as configured: a file's path, or the template's text itself
    (as vLLM's ``--chat-template``).

    Raises:
        ValueError: neither an existing file nor a Jinja template.
    """
    path = Path(value)
    if "\n" not in value and len(value) < 4096 and path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


@cache
def template_takes_tools(template: str | None) -> bool:
    """Whether a Jinja chat template reads a ``tools`` variable (parsed once per template)."""
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


@dataclass(frozen=True, slots=True)
class ChatTemplates:
    """Which template renders a chat request (see the module docstring).

    Args:
        configured: ``chat_template``'s text; None: the model's own.
        model: the model's own template; None where it has none.
    """

    configured: str | None
    model: str | None

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, configured: str | None) -> ChatTemplates:
        """The templates for ``tokenizer`` and a ``chat_template`` setting (path or text).

        Raises:
            ValueError: see :func:`read_template`.
        """
        own = getattr(tokenizer, "chat_template", None)
        own = own if isinstance(own, str) else None
        return cls(None if configured is None else read_template(configured), own)

    def for_request(self, tools: bool) -> str:
        """The template for a request (``tools``: it renders tools, calls or tool answers)."""
        if self.configured is not None:
            return self.configured
        if self.model is not None and (not tools or template_takes_tools(self.model)):
            return self.model
        return shipped_template()

    def describe(self) -> str:
        """The template that renders tools, in words (the ready line, ``/v1/models``)."""
        if self.configured is not None:
            return "configured"
        if template_takes_tools(self.model):
            return "model"
        return "hermes (shipped)"


def render(
    req: ChatCompletionRequest,
    use: ToolUse | None,
    tokenizer: PreTrainedTokenizerBase,
    templates: ChatTemplates,
) -> str:
    """The prompt of a chat request: its messages (with their calls and tool answers),
    and the tools it may call, through its template.

    Raises:
        ApiError: 400 naming ``messages`` when the template refuses them.
    """
    try:
        messages = [_message(m) for m in req.messages]
        tools = None
        if use is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        uses_tools = tools is not None or any(
            m.tool_calls or m.role == "tool" for m in req.messages
        )
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=templates.for_request(uses_tools),
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception as e:  # jinja errors from a template: bad messages
        raise ApiError(
            400,
            f"messages: cannot apply the chat template: {e}",
            param="messages",
            code="invalid_value",
        ) from None


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it.

    Raises:
        ValueError: a content part other than text.
    """
    msg: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        # As vLLM hands them to templates: arguments as an object, which templates write
        # with `tojson` (the request carries them as JSON text).
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": json.loads(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    return msg
