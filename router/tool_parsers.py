"""Tool-call formats: the grammar that makes a model's calls valid, and the parser that
turns its output back into OpenAI's ``tool_calls``, for each format a model is trained on.

A format (``tool_call_parser`` in the config) knows two things of its model's output:
how a call is written, so it can build the xgrammar structural tag that constrains it
(:meth:`ToolCallFormat.structural_tag`), and how to read calls back, whole
(:meth:`ToolCallFormat.scan` with ``final``) or from a prefix of the output while it
streams.

Streaming rests on one property of :meth:`ToolCallFormat.scan`: on a prefix of the output
it returns only what no later token can change, so each scan's content and each call's
name and arguments are prefixes of the final scan's. A stream sends the difference between
successive scans (:class:`ToolCallStream`), so the reassembled deltas equal the response
that is not streamed, by construction. The one exception is a call cut by ``max_tokens``:
the final scan gives its text back as content (it is not a call), while a stream has
already sent its start as a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

ToolMode = Literal["auto", "required", "named"]
"""How the model may call: ``auto`` (text or calls), ``required`` (calls only, at least
one), ``named`` (exactly one call, to the one function given)."""


@dataclass(slots=True)
class ScannedCall:
    """One call read from the output, or the part of it known so far."""

    name: str | None
    """None until the name is complete."""
    arguments: str
    """The arguments' JSON text as the model wrote it (so far)."""
    complete: bool = False


@dataclass(slots=True)
class Scan:
    """What an output holds: its text outside calls, and its calls."""

    content: str
    calls: list[ScannedCall] = field(default_factory=list)


class ToolCallFormat(Protocol):
    """A model's way of writing tool calls."""

    name: str

    def structural_tag(
        self, tools: list[tuple[str, dict[str, Any]]], mode: ToolMode, parallel: bool
    ) -> dict[str, Any]:
        """The xgrammar structural tag that admits exactly the outputs ``mode`` allows.

        Args:
            tools: ``(function name, arguments' JSON schema)`` of every callable function
                (for ``named``: the one).
            parallel: more than one call may be made.
        """
        ...

    def scan(self, text: str, final: bool) -> Scan:
        """Read ``text``; with ``final`` False it may be cut anywhere, and only what no
        continuation can change is returned (see the module docstring)."""
        ...


class TaggedJsonFormat:
    """Calls written as a JSON object ``{"name": ..., <args key>: {...}}``, found by a
    start marker (which may be the object's own opening) and closed by an end marker.

    Args:
        name: the ``tool_call_parser`` value.
        start: the text that starts a call (the structural tag's trigger).
        opens: ``start`` is the call's own first characters (``{"name": ``), not a tag
            around it.
        args_key: the key of the arguments (``arguments``, ``parameters``).
        end: what closes a call after its object ("" for none).
        separator: what goes between two calls when only calls may be written.
    """

    def __init__(
        self, name: str, start: str, opens: bool, args_key: str, end: str, separator: str
    ) -> None:
        self.name = name
        self.start, self.opens, self.args_key = start, opens, args_key
        self.end, self.separator = end, separator
        self._head = re.compile(
            r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + re.escape(args_key) + r'"\s*:\s*'
        )
        self._close = re.compile(r"\s*" + re.escape(end.strip())) if end.strip() else None

    def structural_tag(
        self, tools: list[tuple[str, dict[str, Any]]], mode: ToolMode, parallel: bool
    ) -> dict[str, Any]:
        lead = "" if self.opens else self.start + "\n"
        tags = [
            {
                "type": "tag",
                "begin": f'{lead}{{"name": {json.dumps(name)}, "{self.args_key}": ',
                "content": {"type": "json_schema", "json_schema": schema},
                "end": "}" + self.end,
            }
            for name, schema in tools
        ]
        if mode == "named":
            fmt: dict[str, Any] = tags[0]
        elif mode == "required":
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": self.separator,
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
        else:
            fmt = {
                "type": "triggered_tags",
                "triggers": [self.start],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not parallel,
            }
        return {"type": "structural_tag", "format": fmt}

    def scan(self, text: str, final: bool) -> Scan:
        decoder = json.JSONDecoder()
        content: list[str] = []
        calls: list[ScannedCall] = []
        pos = 0
        while True:
            start = text.find(self.start, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - _partial(tail, self.start)])
                break
            body = start if self.opens else start + len(self.start)
            call, end = self._call(text, body, decoder, final)
            if call is None:  # not a call after all: its text is content
                content.append(text[pos:] if final else text[pos:start])
                break
            content.append(text[pos:start])
            calls.append(call)
            if not call.complete:
                break
            pos = end
        return Scan("".join(content), calls)

    def _call(
        self, text: str, body: int, decoder: json.JSONDecoder, final: bool
    ) -> tuple[ScannedCall | None, int]:
        """The call whose text starts at ``body`` and where its text ends; None when it
        is cut (``final``) or not a call."""
        k = body
        while k < len(text) and text[k].isspace():
            k += 1
        head = self._head.match(text, body)
        try:
            obj, e = decoder.raw_decode(text, k)
        except ValueError:
            if final:
                return None, 0
            if head is None:  # the name is not complete yet
                return ScannedCall(None, ""), 0
            return ScannedCall(json.loads(head.group(1)), _settled(text[head.end() :])), 0
        # Either key: models trained on one format sometimes write the other's.
        keys = (self.args_key, "arguments", "parameters")
        args = next((obj[k] for k in keys if k in obj), {}) if isinstance(obj, dict) else None
        if not (
            isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict)
        ):
            return None, 0
        if head is not None:
            arguments = text[head.end() : e - 1].rstrip()
        else:
            arguments = json.dumps(args, ensure_ascii=False)
        if self._close is None:
            return ScannedCall(obj["name"], arguments, complete=True), e
        close = self._close.match(text, e)
        if close is None:
            if final:
                return None, 0
            return ScannedCall(obj["name"], arguments), 0
        return ScannedCall(obj["name"], arguments, complete=True), close.end()


HERMES = TaggedJsonFormat(
    "hermes", "<tool_call>", opens=False, args_key="arguments", end="\n</tool_call>", separator="\n"
)
"""Hermes' format (NousResearch's Hermes 2 Pro; Qwen2.5 and Qwen3 write the same, and the
shipped template asks for it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

LLAMA3_JSON = TaggedJsonFormat(
    "llama3_json", '{"name": ', opens=True, args_key="parameters", end="", separator="; "
)
"""Llama 3.1-3.3's JSON format (its template's "JSON based tool calling"), calls apart by
``; `` as vLLM's ``llama3_json`` parser reads them::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held back: the
    next tokens may complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _settled(arguments: str) -> str:
    """The part of a call's arguments, as written so far, that is certain: up to the last
    ``}`` (which may close the call rather than the arguments), less the spaces before it."""
    last = arguments.rfind("}")
    return arguments if last < 0 else arguments[:last].rstrip()


PARSERS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}
"""``tool_call_parser`` -> its format."""


def call_id() -> str:
    """A new tool-call id, unique (OpenAI's ``call_`` form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def message(scan: Scan) -> dict[str, Any]:
    """The assistant message of a finished output's :meth:`ToolCallFormat.scan`: content
    (None when only calls and whitespace), and ``tool_calls`` when it made calls."""
    calls = [c for c in scan.calls if c.complete]
    out: dict[str, Any] = {"role": "assistant", "content": _content(scan.content, bool(calls))}
    if calls:
        out["tool_calls"] = [
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return out


def _content(text: str, calls: bool) -> str | None:
    return None if calls and not text.strip() else text


class ToolCallStream:
    """One choice's streamed output turned into OpenAI's delta shape: content deltas, and
    for each call first its index, id and name, then fragments of its arguments."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._content = 0
        """Characters of content sent."""
        self._calls: list[tuple[str, int]] = []
        """Each call sent: its id, and the characters of its arguments sent."""

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, delta: str, final: bool) -> dict[str, Any]:
        """The chunk's ``delta`` for ``delta`` more text (``final``: the output ended).

        Content that is only whitespace is held until text follows it, and dropped if the
        output ends in calls, as :func:`message` drops it.
        """
        self.text += delta
        scan = self.fmt.scan(self.text, final)
        out: dict[str, Any] = {}
        calls_complete = any(c.complete for c in scan.calls)
        if final:
            shown = _content(scan.content, calls_complete) or ""
        else:
            shown = scan.content if scan.content.strip() else ""
        if len(shown) > self._content:
            out["content"] = shown[self._content :]
            self._content = len(shown)
        deltas = []
        for i, call in enumerate(scan.calls):
            if call.name is None or (final and not call.complete):
                break
            if i == len(self._calls):
                self._calls.append((call_id(), 0))
                deltas.append(
                    {
                        "index": i,
                        "id": self._calls[i][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            cid, sent = self._calls[i]
            if len(call.arguments) > sent:
                deltas.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
                self._calls[i] = (cid, len(call.arguments))
        if deltas:
            out["tool_calls"] = deltas
        return out
