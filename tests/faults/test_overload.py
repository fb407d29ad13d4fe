"""Overload: far more concurrent requests than the engine has seats. Each gets 200 (and a
whole answer), 429 or 503, and every refusal says when to come back (``Retry-After``);
afterwards every gauge reads 0 and the greedy answer is unchanged."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.faults.conftest import GREEDY, KEY, MAX_NUM_SEQS, LocalServer

pytestmark = pytest.mark.slow

STANDARD = 12
"""Requests of the ``standard`` class (SLOs no host misses: all admitted, in turn)."""
TIGHT = 48
"""Requests of the ``tight`` class, whose SLO no queue meets: refused once they wait."""


async def _one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, bool]:
    """Request ``i``: ``(status, Retry-After, whole answer)``."""
    tight = i >= STANDARD
    headers = {"Authorization": f"Bearer {'sk-batch' if tight else KEY}"}
    if tight:
        headers["x-iterserve-class"] = "tight"
    stream = i % 2 == 0
    # Long enough that the first requests hold every seat past the tight class's hold of
    # 0.3 s on the fastest host: the later tight ones are then refused.
    body = {**GREEDY, "max_tokens": 48, "stream": stream}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        text = (await r.aread()).decode()
    if r.status_code != 200:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"], text
        return r.status_code, r.headers.get("retry-after"), False
    if not stream:
        return 200, None, json.loads(text)["choices"][0]["finish_reason"] == "length"
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    whole = events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    return 200, None, whole and '"finish_reason": "length"' in text


async def test_overload_gets_200_429_or_503_and_every_refusal_a_retry_after(
    fault_server: LocalServer, greedy_text: str
):
    limits = httpx.Limits(max_connections=STANDARD + TIGHT)
    async with httpx.AsyncClient(base_url=fault_server.url, limits=limits, timeout=300) as client:
        # The standard requests first, and the tight ones once they hold every seat, so
        # that the tight ones meet a full engine whatever order the host serves them in.
        standard = [asyncio.ensure_future(_one(client, i)) for i in range(STANDARD)]
        while fault_server.engine.load_snapshot().total_running < MAX_NUM_SEQS:
            assert not any(t.done() for t in standard), [t.result() for t in standard]
            await asyncio.sleep(0.01)
        tight = await asyncio.gather(*(_one(client, i) for i in range(STANDARD, STANDARD + TIGHT)))
        results = [*await asyncio.gather(*standard), *tight]
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert 200 in statuses and 429 in statuses, statuses  # it was overloaded, and served
    for status, retry_after, whole in results:
        if status == 200:
            assert whole
        else:
            assert retry_after is not None and int(retry_after) >= 1, results
    gauges = await asyncio.to_thread(fault_server.wait_idle)
    assert gauges == dict.fromkeys(gauges, 0.0)
    r = await asyncio.to_thread(fault_server.complete)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text
