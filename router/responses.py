"""OpenAI response bodies and SSE chunks from the replicas' step items.

A request has one call per prompt (completions may send several); its choices are indexed
across prompts and ``n`` (prompt ``p``, sequence ``i``: ``p * n + i``), as OpenAI and vLLM
index them. ``echo`` puts each prompt (and, with ``logprobs``, its log-probabilities)
before its choices' text; a scores-only request (``max_tokens: 0``) drops the one token
the engine sampled.

A request may carry a deadline for its first step items (:class:`StartBy`, the ingress's
queue bound): past it, :class:`QueueTimeout` ends the response, as a 429 or, in a stream,
as an error event. A stream also sends an SSE comment (:data:`KEEPALIVE`) after every
``keepalive_s`` without a chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from router import openai_format as fmt
from router import tool_parsers
from router.calls import ReplicaLost
from router.contract import ReplicaCall, SequenceDelta, StepItem
from router.errors import ApiError
from router.metrics import RequestRecord
from router.schemas import ApiRequest
from router.tool_parsers import ToolCallStream
from router.tools import ToolUse

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class Answer:
    """One request's whole answer, as the API would send it: its status, its request id
    (empty when refused before it had one) and its JSON body."""

    status: int
    request_id: str
    body: dict[str, Any]
    completion_tokens: int = 0


@dataclass(slots=True)
class PromptCall:
    """One prompt of a request and its call to a replica."""

    ids: list[int]
    text: str
    dispatch: ReplicaCall
    prompt_logprobs: list[dict[int, float] | None] | None = None
    record: RequestRecord | None = None
    """The metrics record of the call (None: not measured)."""


@dataclass(slots=True)
class Reply:
    """What one response is made of."""

    req: ApiRequest
    chat: bool
    rid: str
    model: str
    tokenizer: PreTrainedTokenizerBase
    calls: list[PromptCall]
    scores_only: bool = False
    start_by: StartBy | None = None
    """The deadline of every prompt's first step item (:func:`merged`); None: none."""
    tool_use: ToolUse | None = None
    """How a chat request may call tools; its output is read as calls (None: text)."""

    @property
    def echo(self) -> bool:
        return not self.chat and self.req.echo

    @property
    def prompt_tokens(self) -> int:
        return sum(c.dispatch.prompt_tokens for c in self.calls)

    def usage(self, completion_tokens: int) -> dict:
        cached = sum(c.dispatch.cached_tokens for c in self.calls)
        return fmt.usage(self.prompt_tokens, completion_tokens, cached)

    def logprobs(self, token_ids: list[int], entries: list) -> dict | None:
        if not fmt.wants_logprobs(self.req, self.chat):
            return None
        return fmt.logprobs_object(self.tokenizer, token_ids, entries, self.req, self.chat)


@dataclass(slots=True)
class _Choice:
    """One choice, accumulated for a non-streamed response."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)


KEEPALIVE = ": keepalive\n\n"
"""The SSE comment a quiet stream sends (a line starting with ``:``, which SSE clients
skip), so that an idle timeout between client and server does not cut it."""


class QueueTimeout(Exception):
    """A request's prompt did not start (no first step item) by its deadline.

    Args:
        bound_s: the bound it was held to, seconds from arrival at the ingress.
        source: what set the bound, for the message (a class's TTFT SLO, or
            ``max_queue_time_s``).
    """

    def __init__(self, bound_s: float, source: str) -> None:
        super().__init__(
            f"the request could not start within {bound_s:g} s of its arrival ({source}); "
            "the server is overloaded, retry later"
        )
        self.bound_s = bound_s
        self.source = source

    def error(self, retry_after_s: int) -> ApiError:
        """The API's answer: 429 (type ``rate_limit_error``), code ``queue_timeout``,
        with a Retry-After."""
        return ApiError(
            429,
            str(self),
            code="queue_timeout",
            headers={"Retry-After": str(retry_after_s)},
        )


@dataclass(frozen=True, slots=True)
class StartBy:
    """The deadline by which every prompt of a request must have started.

    ``at`` is on ``time.monotonic``; ``bound_s`` and ``source`` name the bound for the
    refusal's message (:class:`QueueTimeout`)."""

    at: float
    bound_s: float
    source: str


_QUIET = None
"""What :func:`_events` yields after ``idle_s`` without an item."""
_TICK = -1
"""The prompt index of a timer's entry in :func:`_events`' queue."""
_DEADLINE, _IDLE = object(), object()


async def _events(
    calls: list[PromptCall], start_by: StartBy | None, idle_s: float | None
) -> AsyncIterator[tuple[int, StepItem] | None]:
    """:func:`merged`'s items, and None after every ``idle_s`` seconds without one.

    The deadline and the quiet spells are timers that drop an entry in the queue the
    items come through, so that waiting for the next item costs nothing more per item
    (this runs for every token of every stream).

    Raises:
        QueueTimeout: a call has no item at ``start_by.at``.
        ReplicaLost, ApiError: as the call's ``items()`` raises them.
    """
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    last = time.monotonic()  # when the consumer last got an item (or a quiet tick)
    timers: list[asyncio.TimerHandle] = []

    async def pump(p: int, call: PromptCall) -> None:
        try:
            async for item in call.dispatch.items():
                await queue.put((p, item))
            await queue.put((p, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((p, e))

    def quiet_check() -> None:
        assert idle_s is not None
        left = last + idle_s - time.monotonic()
        if left <= 0:
            queue.put_nowait((_TICK, _IDLE))
            left = idle_s
        timers[-1] = loop.call_later(left, quiet_check)

    if start_by is not None:
        timers.append(
            loop.call_later(
                max(0.0, start_by.at - time.monotonic()), queue.put_nowait, (_TICK, _DEADLINE)
            )
        )
    if idle_s is not None:
        timers.append(loop.call_later(idle_s, quiet_check))
    tasks = [asyncio.create_task(pump(p, c)) for p, c in enumerate(calls)]
    waiting = set(range(len(calls)))  # calls that have not yielded their first item
    try:
        left = len(calls)
        while left:
            p, item = await queue.get()
            if p == _TICK:
                if item is _DEADLINE and waiting:
                    assert start_by is not None
                    raise QueueTimeout(start_by.bound_s, start_by.source)
                if item is _IDLE:
                    last = time.monotonic()
                    yield _QUIET
                continue
            waiting.discard(p)
            if item is None:
                left -= 1
                continue
            if isinstance(item, Exception):
                raise item
            if item.prompt_logprobs is not None:
                calls[p].prompt_logprobs = item.prompt_logprobs
            last = time.monotonic()
            yield p, item
    finally:
        for timer in timers:
            timer.cancel()
        for t in tasks:
            t.cancel()


async def merged(
    calls: list[PromptCall], start_by: StartBy | None = None
) -> AsyncIterator[tuple[int, StepItem]]:
    """``(prompt index, step item)`` from every call, as they come; a call's prompt
    log-probabilities are kept on it.

    ``start_by``: every call must yield its first item by then. A replica's first step
    item comes with the request's first token (the engine reports nothing of a step that
    only prefilled part of a prompt), so the deadline bounds the time to first token:
    the wait in queues and the prefill.

    Raises:
        QueueTimeout: a call had no item at ``start_by``; the caller cancels the calls.
        ReplicaLost, ApiError: as the call's ``items()`` raises them.
    """
    async for event in _events(calls, start_by, None):
        assert event is not None
        yield event


def _echo_parts(reply: Reply, p: int) -> tuple[str, list[int], list]:
    call = reply.calls[p]
    entries = call.prompt_logprobs or [None] * len(call.ids)
    return call.text, call.ids, entries


async def collect(reply: Reply, start_by: StartBy | None = None) -> dict:
    """The non-streamed response body.

    Raises:
        QueueTimeout: a prompt had not started at ``start_by`` (:func:`merged`).
        ReplicaLost, ApiError: as the calls' ``items()`` raise them.
    """
    n = reply.req.n
    choices = [_Choice() for _ in range(len(reply.calls) * n)]
    async for p, item in merged(reply.calls, start_by):
        for o in item.outputs:
            c = choices[p * n + o.index]
            if not reply.scores_only:
                c.text.append(o.text)
                c.token_ids.extend(o.token_ids)
                c.logprobs.extend(o.logprobs or [])
            if o.finish_reason:
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
    out = []
    for k, c in enumerate(choices):
        text, ids, entries = "".join(c.text), c.token_ids, c.logprobs
        if reply.echo:
            ptext, pids, pentries = _echo_parts(reply, k // n)
            text, ids, entries = ptext + text, pids + ids, pentries + entries
        choice: dict[str, Any] = {
            "index": k,
            "logprobs": reply.logprobs(ids, entries),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if reply.tool_use is not None:
            choice["message"] = tool_parsers.message(reply.tool_use.format.scan(text, final=True))
            if "tool_calls" in choice["message"] and c.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        elif reply.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out.append(choice)
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "id": reply.rid,
        "object": "chat.completion" if reply.chat else "text_completion",
        "created": int(time.time()),
        "model": reply.model,
        "choices": out,
        "usage": reply.usage(completion),
    }


def _stream_choice(
    reply: Reply, k: int, o: SequenceDelta, first: bool, calls: ToolCallStream | None
) -> dict:
    """One chunk's choice ``k`` for delta ``o`` (``calls``: the choice's tool-call reader,
    which turns its text into content and call deltas)."""
    text, ids, entries = o.text, o.token_ids, o.logprobs or []
    if reply.scores_only:
        text, ids, entries = "", [], []
    if first and reply.echo:
        ptext, pids, pentries = _echo_parts(reply, k // reply.req.n)
        text, ids, entries = ptext + text, pids + ids, pentries + entries
    choice: dict[str, Any] = {
        "index": k,
        "logprobs": reply.logprobs(ids, entries),
        "finish_reason": o.finish_reason,
    }
    if o.finish_reason:
        choice["stop_reason"] = o.stop_reason
    if calls is not None:
        choice["delta"] = calls.feed(text, final=o.finish_reason is not None)
        if o.finish_reason == "stop" and calls.made_calls:
            choice["finish_reason"] = "tool_calls"
    elif reply.chat:
        choice["delta"] = {"content": text} if text else {}
    else:
        choice["text"] = text
    return choice


async def stream(
    reply: Reply,
    start_by: StartBy | None = None,
    keepalive_s: float | None = None,
    timed_out: Callable[[QueueTimeout], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE chunks of a streamed response, ending with ``data: [DONE]``.

    Args:
        start_by: the deadline of every prompt's first step item (:func:`merged`); past
            it the stream sends an error event (:meth:`QueueTimeout.error`'s body), then
            ``data: [DONE]``, and its calls are cancelled.
        keepalive_s: after this many seconds without a chunk, send :data:`KEEPALIVE`
            (again after as many more); None: never.
        timed_out: told of the :class:`QueueTimeout` before the error event is sent.
    """
    created = int(time.time())
    obj = "chat.completion.chunk" if reply.chat else "text_completion"
    opts = reply.req.stream_options
    include_usage = bool(opts and opts.include_usage)
    completion, seen = 0, set()
    use = reply.tool_use
    readers = [
        ToolCallStream(use.format) if use is not None else None
        for _ in range(len(reply.calls) * reply.req.n)
    ]

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        data: dict[str, Any] = {
            "id": reply.rid,
            "object": obj,
            "created": created,
            "model": reply.model,
            "choices": choices,
        }
        if include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    try:
        if reply.chat:
            for i in range(reply.req.n):
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
        async for event in _events(reply.calls, start_by, keepalive_s):
            if event is _QUIET:
                yield KEEPALIVE
                continue
            p, item = event
            for o in item.outputs:
                k = p * reply.req.n + o.index
                completion += 0 if reply.scores_only else len(o.token_ids)
                yield chunk([_stream_choice(reply, k, o, k not in seen, readers[k])])
                seen.add(k)
        if include_usage:
            yield chunk([], reply.usage(completion))
    except (ReplicaLost, ApiError, QueueTimeout) as e:
        if isinstance(e, QueueTimeout):
            if timed_out is not None:
                timed_out(e)
            err = e.error(retry_after(e.bound_s))
        elif isinstance(e, ApiError):
            err = e
        else:
            err = ApiError(503, str(e), code="replica_lost")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        for c in reply.calls:
            c.dispatch.cancel()
    yield "data: [DONE]\n\n"


def retry_after(bound_s: float) -> int:
    """Retry-After seconds for a request refused past its queue bound of ``bound_s``: as
    long as it waited, so that retries back off as the overload does."""
    return max(1, math.ceil(bound_s))
