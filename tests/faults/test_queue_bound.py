"""No silent stream: a request that cannot start within its class's queue bound is
refused (429 before anything was sent, an error event in an open stream), and a stream
that waits sends SSE comments, which the clients that read it skip."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from bench.toolkit.targets import SseTokens
from router.ingress import Ingress
from tests.faults.queue_fakes import SlowReplica, ingress, metric

TIGHT = {"standard": {"ttft_slo_s": 0.1}}  # so that max_queue_time_s sets the bound


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def _body(stream: bool, max_tokens: int = 4) -> dict:
    return {"model": "m", "prompt": "abc", "max_tokens": max_tokens, "stream": stream}


def _refusals(ing: Ingress, cls: str = "standard") -> float:
    labels = {"model": "m", "traffic_class": cls, "reason": "queue_timeout"}
    return metric(ing, "admission_rejections_total", **labels)


async def _aborted(replica: SlowReplica) -> int:
    for _ in range(100):  # the abort lands at the replica stream's next await
        if replica.running == 0:
            break
        await asyncio.sleep(0.01)
    assert replica.running == 0
    return replica.aborted


async def test_a_request_queued_past_its_bound_gets_429_and_is_aborted():
    replica = SlowReplica(start_s=3600)  # queued behind work that never ends
    ing, app = ingress(replica, TIGHT, max_queue_time_s=0.3)
    async with _client(app) as client:
        r = await asyncio.wait_for(client.post("/v1/completions", json=_body(False)), 30)
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_timeout"
    assert "0.3 s" in err["message"] and "max_queue_time_s" in err["message"]
    assert await _aborted(replica) == 1
    assert _refusals(ing) == 1
    # Refused, not aborted by its client.
    assert metric(ing, "request_aborted_total", model="m", traffic_class="standard") == 0


async def test_a_waiting_stream_sends_comments_then_an_error_event_and_done():
    replica = SlowReplica(start_s=3600)
    ing, app = ingress(replica, TIGHT, max_queue_time_s=0.5, stream_keepalive_s=0.1)
    async with _client(app) as client:
        r = await asyncio.wait_for(client.post("/v1/completions", json=_body(True)), 30)
    assert r.status_code == 200
    lines = [x for x in r.text.split("\n") if x]
    comments = [x for x in lines if x.startswith(":")]
    assert len(comments) >= 2 and lines[: len(comments)] == comments, lines
    assert lines[-1] == "data: [DONE]" and len(lines) == len(comments) + 2, lines
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["code"] == "queue_timeout" and "max_queue_time_s" in err["message"]
    assert await _aborted(replica) == 1
    assert _refusals(ing) == 1


async def test_a_class_whose_ttft_slo_is_longer_waits_up_to_it():
    ing, _ = ingress(SlowReplica(), {"interactive": {"ttft_slo_s": 90.0}}, max_queue_time_s=20)
    assert ing.queue_bounds["interactive"] == (
        90.0,
        "the interactive class's TTFT SLO, ttft_slo_s",
    )
    assert ing.queue_bounds["standard"] == (20.0, "the server's max_queue_time_s")


async def test_a_class_never_refused_for_its_slo_waits_its_turn_kept_alive():
    """``batch`` (``rejectable: false``) has no queue bound: past ``max_queue_time_s`` and
    its TTFT SLO, its stream still gets its tokens, with comments while it waits."""
    replica = SlowReplica(start_s=0.6, step_s=0.0)
    classes = {"batch": {"ttft_slo_s": 0.1}}
    ing, app = ingress(replica, classes, max_queue_time_s=0.1, stream_keepalive_s=0.1)
    assert ing.queue_bounds["batch"] is None
    async with _client(app) as client:
        r = await client.post(
            "/v1/completions", json=_body(True), headers={"x-iterserve-class": "batch"}
        )
    assert r.status_code == 200 and ": keepalive" in r.text
    assert r.text.count('"text": "x"') == 4 and r.text.endswith("data: [DONE]\n\n")
    assert _refusals(ing, "batch") == 0


async def test_admission_holds_no_longer_than_the_bound():
    """A request admission would hold for ever is refused at the bound, before its stream
    opens: a 429 and nothing sent to a replica."""
    replica = SlowReplica()
    ing, app = ingress(replica, {"standard": {"ttft_slo_s": 0.3}}, max_queue_time_s=0.1)
    ing.admission.enabled = True

    async def held_for_ever(*args, **kwargs) -> float:
        await asyncio.Event().wait()
        return 0.0

    ing.admission.admit = held_for_ever
    async with _client(app) as client:
        r = await asyncio.wait_for(client.post("/v1/completions", json=_body(True)), 30)
    assert r.status_code == 429 and "retry-after" in r.headers, r.text
    err = r.json()["error"]
    assert err["code"] == "queue_timeout" and "ttft_slo_s" in err["message"]
    assert replica.running == replica.aborted == 0
    assert _refusals(ing) == 1


@pytest.mark.parametrize("chat", [False, True])
async def test_clients_read_a_stream_across_its_comments(chat):
    """The ``openai`` client and the benchmarks' own SSE reader skip the comments of a
    stream that waited before its first token and get every token."""
    replica = SlowReplica(start_s=0.4, step_s=0.0)
    _, app = ingress(replica, max_queue_time_s=30, stream_keepalive_s=0.05)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(True, max_tokens=5)
    if chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    async with _client(app) as http:
        raw = (await http.post(path, json=body)).text
        oa = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http)
        create = oa.chat.completions.create if chat else oa.completions.create
        stream = await create(**{k: v for k, v in body.items() if k != "stream"}, stream=True)
        parts = [
            (c.choices[0].delta.content if chat else c.choices[0].text) or ""
            async for c in stream
            if c.choices
        ]
    assert raw.count(": keepalive") >= 2, raw
    assert "".join(parts) == "xxxxx"
    if not chat:
        events = SseTokens({})
        tokens = sum(events.feed(line) for line in raw.split("\n"))
        assert tokens == 5 and events.done


def test_serve_flags_set_the_bound_and_the_keepalive(monkeypatch):
    import deploy.server
    from deploy.cli import build_parser

    seen = []
    monkeypatch.setattr(deploy.server, "run_server", lambda config, address: seen.append(config))
    argv = ["serve", "--max-queue-time-s", "7.5", "--stream-keepalive-s", "2"]
    args = build_parser().parse_args(argv)
    args.func(args)
    (config,) = seen
    assert (config.max_queue_time_s, config.stream_keepalive_s) == (7.5, 2.0)
    settings = config.ingress_settings()
    assert (settings.max_queue_time_s, settings.stream_keepalive_s) == (7.5, 2.0)
