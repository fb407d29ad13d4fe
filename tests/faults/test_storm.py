"""A disconnect storm: many clients hang up at once, streamed and not, before an answer,
while queued and mid-stream. Afterwards the server must be as before: every gauge at 0,
every KV block free, and the same greedy answer to the same request."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from tests.faults.conftest import GREEDY, LocalServer, address, raw_head

pytestmark = pytest.mark.slow

LONG = {**GREEDY, "max_tokens": 400}
"""A request that would run for minutes: only its client's hang-up ends it early."""
STREAMS = 16
BLOCKING = 8
"""Streamed and non-streamed clients in the storm; more than the engine's seats, so some
hang up while queued."""


async def _hang_up(server: LocalServer, stream: bool, events: int, reset: bool) -> int:
    """Send :data:`LONG`, read ``events`` SSE events (0: not even the head), hang up: with
    a TCP reset (``reset``) or a plain close. Returns the events read."""
    host, port = address(server)
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps({**LONG, "stream": stream}).encode()
    writer.write(raw_head(server, "/v1/completions", len(body)) + body)
    await writer.drain()
    seen = 0
    if not stream and events:
        await asyncio.sleep(0.5)  # long enough to be admitted, far too short to finish
    while stream and seen < events:
        line = await asyncio.wait_for(reader.readline(), 120)
        assert line, "the server closed the stream first"
        seen += line.startswith(b"data: ")
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    return seen


async def test_a_disconnect_storm_leaves_nothing_behind(fault_server: LocalServer, greedy_text):
    server = fault_server
    await asyncio.to_thread(server.wait_idle)
    storm = [
        _hang_up(server, stream=True, events=i % 4, reset=i % 2 == 0) for i in range(STREAMS)
    ] + [_hang_up(server, stream=False, events=i % 2, reset=i % 3 == 0) for i in range(BLOCKING)]
    seen = await asyncio.gather(*storm)
    # Most streams were running (had produced events) when their clients left.
    assert sum(n > 0 for n in seen[:STREAMS]) >= STREAMS // 2, seen
    gauges = await asyncio.to_thread(server.wait_idle)
    assert gauges == dict.fromkeys(gauges, 0.0)
    assert not server.engine.dead
    r = await asyncio.to_thread(server.complete)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text
    await asyncio.to_thread(server.wait_idle)
