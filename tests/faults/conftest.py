"""The fault suite's shared server: ``iterserve serve``'s one-process server (the engine in
the server's process, no Ray), run on a thread of the test process, so that a test can
reach into its engine (inject a failure, read its KV blocks) while it serves HTTP.

One server serves the whole folder (session scope): the model loads once. A test that
needs a fresh engine (one it kills) builds its own with :func:`local_server`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from deploy.config import ServiceConfig
from deploy.engine_replica import EngineReplica
from deploy.top import scrape, totals
from engine import AsyncLLMEngine
from tests.serving_app import MODEL, free_port, running_local

KEY = "sk-standard"
"""The API key every fault test sends (class ``standard``)."""
NUM_KV_BLOCKS = 256
MAX_NUM_SEQS = 8
QUEUE_CAP = 12
"""The ``capped`` class's ``hard_queue_cap``."""
PROMPT = "The capital of France is"
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
"""A short greedy request whose answer a fault must not change."""
GAUGES = (
    "iterserve:num_requests_running",
    "iterserve:num_requests_waiting",
    "iterserve:num_requests_held",
    "iterserve:kv_cache_usage_perc",
)
"""The ``/metrics`` series that read 0 on an idle server."""


def fault_config(**engine) -> ServiceConfig:
    """The fault suite's service: one replica, two keys, a ``standard`` class whose SLOs
    no host misses, a ``tight`` class that admission refuses under any queue (it waits at
    most 0.3 s), a ``capped`` class like ``standard`` but refused once :data:`QUEUE_CAP`
    of its requests wait, and the engine's ``engine`` fields."""
    return ServiceConfig(
        num_replicas=1,
        port=free_port(),
        api_keys={
            KEY: {"tenant": "carol", "traffic_class": "standard"},
            "sk-batch": {"tenant": "bob", "traffic_class": "batch"},
        },
        engine={
            "num_kv_blocks": NUM_KV_BLOCKS,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_model_len": 2048,
            "traffic_classes": {
                # Admission must not refuse the tests' own requests on a slow, loaded host.
                "standard": {"ttft_slo_s": 300.0, "tpot_slo_s": 30.0, "max_queue_wait_s": 300.0},
                "capped": {
                    "ttft_slo_s": 300.0,
                    "tpot_slo_s": 30.0,
                    "default_priority": 3,
                    "max_queue_wait_s": 300.0,
                    "hard_queue_cap": QUEUE_CAP,
                },
                "tight": {
                    "ttft_slo_s": 0.01,
                    "tpot_slo_s": 0.01,
                    "default_priority": 3,
                    "max_queue_wait_s": 0.3,
                },
            },
            **engine,
        },
    )


@dataclass
class LocalServer:
    """A running one-process server: its base URL and its replica."""

    url: str
    replica: EngineReplica

    @property
    def engine(self) -> AsyncLLMEngine:
        return self.replica.engine

    def post(self, path: str, body: dict, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=120, **kw)

    def complete(self, body: dict | None = None) -> httpx.Response:
        return self.post("/v1/completions", body or GREEDY)

    def gauges(self) -> dict[str, float]:
        """Each of :data:`GAUGES` from ``/metrics``, summed over its labels."""
        return totals(scrape(self.url, timeout_s=10), GAUGES)

    def free_blocks(self) -> int:
        return self.engine.engine.block_manager.num_free_blocks

    def wait_idle(self, timeout_s: float = 60) -> dict[str, float]:
        """Wait until the gauges read 0, every KV block is free and the engine holds no
        request; the gauges then. A generous bound: a loaded host steps slowly, and an
        aborted request leaves at the next step.

        Raises:
            AssertionError: still busy after ``timeout_s``.
        """
        bm = self.engine.engine.block_manager
        deadline = time.monotonic() + timeout_s
        while True:
            gauges = self.gauges()
            if (
                not any(gauges.values())
                and bm.num_free_blocks == bm.num_blocks
                and not self.engine.engine.has_unfinished_requests()
                and self.engine.num_unfinished == 0
            ):
                bm.check()
                return gauges
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not idle after {timeout_s} s: {gauges}, "
                    f"{bm.num_free_blocks}/{bm.num_blocks} blocks free, "
                    f"{self.engine.num_unfinished} streams open"
                )
            time.sleep(0.1)


@contextmanager
def local_server(config: ServiceConfig) -> Iterator[LocalServer]:
    """``config`` served as ``iterserve serve`` serves one replica, from a thread of this
    process (:func:`tests.serving_app.running_local`)."""
    with running_local(config) as (url, replica):
        yield LocalServer(url, replica)


@pytest.fixture(scope="session")
def fault_server() -> Iterator[LocalServer]:
    """The folder's shared server (:func:`fault_config`); a test leaves it idle."""
    with local_server(fault_config()) as server:
        yield server


@pytest.fixture(scope="session")
def greedy_text(fault_server: LocalServer) -> str:
    """:data:`GREEDY`'s text on the shared server before any fault test disturbed it."""
    r = fault_server.complete()
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@dataclass
class Streamed:
    """One streamed request as the client saw it."""

    status: int
    events: list[dict]
    """The ``data:`` events before ``[DONE]`` (the error body when ``status`` is not 200)."""
    done: bool
    """``data: [DONE]`` ended the stream."""

    @property
    def text(self) -> str:
        return "".join(
            c.get("text") or (c.get("delta") or {}).get("content") or ""
            for e in self.events
            for c in e.get("choices", [])
        )

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            for c in e.get("choices", [])
            if c.get("finish_reason")
        ]


def stream(server: LocalServer, body: dict, path: str = "/v1/completions") -> Streamed:
    """POST ``body`` with ``stream: true`` and read the whole stream."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"{server.url}{path}", json={**body, "stream": True}, headers=headers, timeout=120
    ) as r:
        if r.status_code != 200:
            r.read()
            return Streamed(r.status_code, [r.json()], False)
        events, done = [], False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            events.append(json.loads(line[len("data: ") :]))
    return Streamed(200, events, done)


def raw_head(server: LocalServer, path: str, length: int, key: str | None = KEY) -> bytes:
    """An HTTP/1.1 POST head for a JSON body of ``length`` bytes (sent apart, by a raw
    socket: a client that hangs up or dribbles its body)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    host = server.url.removeprefix("http://")
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


def address(server: LocalServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)
