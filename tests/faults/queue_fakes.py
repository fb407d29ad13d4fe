"""An ingress over a replica whose timing the test sets, with no model: the faults' unit
tests drive it through its ASGI app, as uvicorn or Ray Serve's proxy would."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from policies import make_classes
from policies.limits import RequestLimits
from router.contract import Accepted, ModelInfo, SequenceDelta, StepItem
from router.ingress import Ingress, add_routes, make_app
from router.local import LocalReplicas


class Tokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, tokenize: bool = False, **kwargs) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


class _Engine:
    dead = False

    def load_snapshot(self):
        raise AssertionError("admission is off in these tests")


class SlowReplica:
    """A replica (``router.local.LocalReplica``) that queues each request ``start_s``
    seconds before its first token, then makes one token (``x``) every ``step_s``.

    ``running`` counts the requests it is serving now; ``aborted`` those whose item stream
    was closed before their end (what aborts an engine request)."""

    replica_id = "slow"
    engine = _Engine()

    def __init__(self, start_s: float = 0.0, step_s: float = 0.01) -> None:
        self.start_s, self.step_s = start_s, step_s
        self.running = 0
        self.aborted = 0

    def info(self) -> ModelInfo:
        return ModelInfo(Tokenizer(), RequestLimits(4096, 1 << 20, 1 << 16))

    async def items(self, request_id, prompt_token_ids, params, shape, send_load=True):
        yield Accepted(len(prompt_token_ids), self.replica_id)
        self.running += 1
        n, done = params.max_tokens or 16, False
        try:
            await asyncio.sleep(self.start_s)
            for i in range(n):
                last = i == n - 1
                delta = SequenceDelta(0, "x", [120], None, "length" if last else None, None)
                yield StepItem([delta], last, queue_s=self.start_s if i == 0 else None)
                await asyncio.sleep(self.step_s)
            done = True
        finally:
            self.running -= 1
            self.aborted += not done

    def record_routing_stats(self) -> dict:
        return {}


def ingress(replica: SlowReplica, classes: dict[str, dict[str, Any]] | None = None, **settings):
    """An :class:`Ingress` over ``replica`` (admission off), built as the Ray Serve
    deployment builds its own (no ``watch_disconnects`` argument), and its ASGI app.
    ``classes``: traffic-class overrides (``engine.traffic_classes``' form)."""
    fields = {n: dataclasses.asdict(c) for n, c in make_classes(classes).items()}
    ing = Ingress(
        LocalReplicas(replica),
        {"model_name": "m", "admission": False, "traffic_classes": fields, **settings},
    )
    app = make_app()
    add_routes(app, ing)
    return ing, app


def metric(ingress_: Ingress, name: str, **labels: str) -> float:
    """The value of one ``iterserve:`` sample (0 when absent)."""
    value = ingress_.metrics.registry.get_sample_value(f"iterserve:{name}", labels)
    return value or 0.0


async def asgi_post(app, path: str, body: bytes, receive) -> tuple[int, dict[str, str], bytes]:
    """``POST path`` straight to the ASGI ``app``, with the client's side played by
    ``receive`` (an ASGI receive callable); the status, headers and body sent back."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    status, headers, out = 0, {}, bytearray()

    async def send(message: dict) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            out.extend(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, bytes(out)


def client_leaving(body: bytes, after_s: float, send_body: bool = True):
    """An ASGI receive: the client sends ``body`` whole (or, not ``send_body``, only its
    first half, announcing more), then disconnects ``after_s`` seconds later."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            if send_body:
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.request", "body": body[: len(body) // 2], "more_body": True}
        await asyncio.sleep(after_s)
        return {"type": "http.disconnect"}

    return receive
