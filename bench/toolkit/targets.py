"""The load generator's targets: iterserve's engine in this process, or any OpenAI endpoint
(read with httpx, or with aiohttp where the client's own CPU matters).

Each implements :class:`loadgen.Target`; the simulator (``deploy/sim``) takes the same
requests directly (:mod:`bench.sim_validate`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx

from bench.toolkit.loadgen import LoadRequest, Refused

ADMISSION_POLL_S = 0.25
"""How often a held request asks admission again (as the ingress does, bounded by the
decision's own ``max_wait_s``)."""


class EngineTarget:
    """An in-process ``AsyncLLMEngine``, optionally behind the ingress's admission loop.

    With ``admission``, each request asks :attr:`controller` first, as the router does,
    on the engine's load snapshot: Admit goes, Wait sleeps and asks again (``holds``,
    ``held_s`` land in the record), Reject raises :class:`Refused`. With ``predict``, the
    admission model's TTFT prediction at the moment of sending lands in the record as
    ``pred_ttft_s``.
    """

    def __init__(self, aeng, *, admission: bool = False, predict: bool = False) -> None:
        from policies import AdmissionController

        self.aeng = aeng
        self.admission = admission
        self.predict = predict
        self.controller = AdmissionController(
            aeng.engine.traffic_classes, policy=aeng.engine.scheduler.policy
        )
        """The router's admission model over the engine's classes and scheduling policy."""

    @property
    def engine(self):
        """The ``LLMEngine`` inside (step-time model, scheduler counters, block manager)."""
        return self.aeng.engine

    async def stream(self, req: LoadRequest, rec: dict[str, Any]) -> AsyncIterator[int]:
        from engine.core.params import RequestOutputKind, SamplingParams

        cls = req.cls or "interactive"
        start = time.perf_counter()
        if self.admission:
            await self._admit(req, cls, rec, start)
        rec["held_s"] = time.perf_counter() - start
        if self.predict:
            p = self.controller.predict(self.aeng.load_snapshot(), cls, req.prompt_tokens)
            rec["pred_ttft_s"], rec["pred_tpot_s"] = p.ttft_s, p.tpot_s
        prompt = {"prompt_token_ids": req.prompt} if isinstance(req.prompt, list) else req.prompt
        sp = SamplingParams(
            max_tokens=req.max_tokens,
            temperature=0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        async for out in self.aeng.generate(prompt, sp, request_id=req.id, traffic_class=cls):
            yield len(out.outputs[0].token_ids)

    async def _admit(self, req: LoadRequest, cls: str, rec: dict[str, Any], start: float) -> None:
        from policies import Admit, Reject

        priority = self.aeng.engine.traffic_classes[cls].default_priority
        rec["holds"] = 0
        while True:
            waited_s = time.perf_counter() - start
            snap = self.aeng.load_snapshot()
            d = self.controller.decide(
                snap, cls, req.prompt_tokens, req.max_tokens, priority, waited_s
            )
            if isinstance(d, Admit):
                return
            if isinstance(d, Reject):
                rec["held_s"] = time.perf_counter() - start
                raise Refused(d.reason, d.retry_after_s)
            rec["holds"] += 1
            await asyncio.sleep(max(0.0, min(d.max_wait_s, ADMISSION_POLL_S)))


def completions_url(base_url: str) -> str:
    """The completions endpoint for a server root, a ``/v1`` root or the endpoint itself."""
    base = base_url.rstrip("/")
    if base.endswith("/v1/completions"):
        return base
    return base + ("/completions" if base.endswith("/v1") else "/v1/completions")


def http_client(timeout_s: float = 600.0) -> httpx.AsyncClient:
    """A client with no connection limit; ``trust_env=False`` keeps environment proxies out."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(timeout_s),
        trust_env=False,
    )


class HttpTarget:
    """A streaming ``/v1/completions`` endpoint (iterserve, vLLM or any OpenAI server).

    Each request is ``ignore_eos`` and greedy with ``max_tokens`` forced. A class goes in
    ``class_header`` and, with ``priority_field``, as vLLM's ``priority`` from
    ``class_priority``. Counted tokens: one per text chunk, topped up at the end to the
    usage's ``completion_tokens`` when a chunk carried several.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        model: str,
        *,
        class_header: str | None = "x-iterserve-class",
        priority_field: bool = False,
        class_priority: dict[str, int] | None = None,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        self.client = client
        self.url = completions_url(base_url)
        self.model = model
        self.class_header = class_header
        self.priority_field = priority_field
        self.class_priority = class_priority or {}
        self.extra_headers = extra_headers or {}

    def request_parts(self, req: LoadRequest) -> tuple[dict, dict[str, str]]:
        body: dict[str, Any] = {
            "model": req.model or self.model,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = dict(self.extra_headers)
        if req.cls is not None:
            if self.class_header:
                headers[self.class_header] = req.cls
            if self.priority_field:
                body["priority"] = self.class_priority[req.cls]
        return body, headers

    async def stream(self, req: LoadRequest, rec: dict[str, Any]) -> AsyncIterator[int]:
        body, headers = self.request_parts(req)
        async with self.client.stream("POST", self.url, json=body, headers=headers) as resp:
            rec["http_status"] = resp.status_code
            if resp.status_code != 200:
                _raise_for(resp.status_code, (await resp.aread()).decode(errors="replace"))
            events = SseTokens(rec)
            async for line in resp.aiter_lines():
                if n := events.feed(line):
                    yield n
                if events.done:
                    break
            if n := events.rest():
                yield n


class AiohttpTarget(HttpTarget):
    """:class:`HttpTarget` read with aiohttp, the client of vLLM's own load tool
    (``vllm.benchmarks.serve``): for probes whose client shares the server's cores.
    It spends less client CPU per streamed chunk than httpx, which on a 2-core host is CPU
    taken from the server. ``client`` is an ``aiohttp.ClientSession``."""

    async def stream(self, req: LoadRequest, rec: dict[str, Any]) -> AsyncIterator[int]:
        body, headers = self.request_parts(req)
        async with self.client.post(self.url, json=body, headers=headers) as resp:
            rec["http_status"] = resp.status
            if resp.status != 200:
                _raise_for(resp.status, await resp.text(errors="replace"))
            events = SseTokens(rec)
            async for line in resp.content:
                if n := events.feed(line.decode()):
                    yield n
                if events.done:
                    break
            if n := events.rest():
                yield n


def aiohttp_session(timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A session for :class:`AiohttpTarget`, with no connection limit."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
    )


def _raise_for(status: int, text: str) -> None:
    if status == 429:
        raise Refused(text)
    raise RuntimeError(f"HTTP {status}: {text}")


class SseTokens:
    """Output tokens from the ``data:`` lines of a streamed ``/v1/completions`` answer.

    One token per chunk with text; :meth:`rest` tops the count up to the usage's
    ``completion_tokens`` when a chunk carried several. The usage's prompt and cached
    tokens land in ``rec`` (``server_prompt_tokens``, ``cached_tokens``).
    """

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, line: str) -> int:
        """Tokens in one line (0 or 1); ``done`` after ``[DONE]``.

        Raises:
            RuntimeError: the server sent an error event.
        """
        if not line.startswith("data:"):
            return 0
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return 0
        obj = json.loads(data)
        if obj.get("error") is not None:
            raise RuntimeError(json.dumps(obj["error"]))
        usage = obj.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            self.rec["server_prompt_tokens"] = usage["prompt_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.rec["cached_tokens"] = cached
        if usage.get("completion_tokens") is not None:
            self.usage_tokens = usage["completion_tokens"]
        choices = obj.get("choices") or []
        if choices and choices[0].get("text"):
            self.chunks += 1
            return 1
        return 0

    def rest(self) -> int:
        """Tokens the usage counted beyond the chunks, once the stream has ended.

        Raises:
            RuntimeError: the stream ended without ``[DONE]``.
        """
        if not self.done:
            raise RuntimeError("stream ended without [DONE]")
        if self.usage_tokens is not None and self.usage_tokens > self.chunks:
            return self.usage_tokens - self.chunks
        return 0
