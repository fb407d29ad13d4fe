"""A burst that arrives at once meets admission in full: each admitted request is queued at
the engine before its answer starts, so the ones decided after it count it.

64 simultaneous streamed requests of the ``capped`` class (SLOs no host misses, a hard
queue cap of :data:`QUEUE_CAP`, above the engine's :data:`MAX_NUM_SEQS` seats), while the
engine's steps are held back so that no seat frees up meanwhile: the seats' worth are
admitted at once, the rest up to the cap are held, and every other request is refused
at the cap with 429. Had admission missed the burst, all 64 would start at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.faults.conftest import GREEDY, MAX_NUM_SEQS, QUEUE_CAP, LocalServer

pytestmark = pytest.mark.slow

BURST = 64
WAIT_S = 120.0
"""The longest the burst's decisions may take on a slow, loaded host."""


async def test_a_simultaneous_burst_is_admitted_to_the_seats_and_the_cap(
    fault_server: LocalServer, monkeypatch
):
    assert MAX_NUM_SEQS < QUEUE_CAP < BURST
    gate = threading.Event()
    engine = fault_server.engine.engine
    step = engine.step

    def gated_step():
        gate.wait(WAIT_S)
        return step()

    monkeypatch.setattr(engine, "step", gated_step)
    statuses: list[int] = []
    refusals: list[str] = []
    finished = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal finished
        headers = {"Authorization": "Bearer sk-batch", "x-iterserve-class": "capped"}
        body = {**GREEDY, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            statuses.append(r.status_code)
            text = (await r.aread()).decode()
        if r.status_code != 200:
            refusals.append(f"{r.status_code} {json.loads(text)['error']['message']}")
        elif text.rstrip().endswith("data: [DONE]"):
            finished += 1

    limits = httpx.Limits(max_connections=BURST)
    async with httpx.AsyncClient(base_url=fault_server.url, limits=limits, timeout=300) as client:
        tasks = [asyncio.ensure_future(one(client)) for _ in range(BURST)]
        try:
            # Every request but the held ones gets its status while no step runs.
            deadline = time.monotonic() + WAIT_S
            while len(statuses) < BURST - (QUEUE_CAP - MAX_NUM_SEQS):
                assert time.monotonic() < deadline, statuses
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a held request that were let through would show now
            assert statuses.count(200) == MAX_NUM_SEQS, statuses
            assert len(refusals) == BURST - QUEUE_CAP, refusals
            assert all(
                r.startswith("429 ") and f"queue at its cap of {QUEUE_CAP}" in r for r in refusals
            ), refusals
        finally:
            gate.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    # The held requests start as seats free up; every admitted request finishes.
    assert statuses.count(200) == QUEUE_CAP and finished == QUEUE_CAP, (statuses, finished)
    gauges = await asyncio.to_thread(fault_server.wait_idle)
    assert gauges == dict.fromkeys(gauges, 0.0)
