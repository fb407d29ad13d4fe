"""A slow client: one stream whose client does not read (its socket's buffers fill, and
the server's writes to it wait) must not stall the other streams, nor the engine."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.faults.conftest import GREEDY, LocalServer, address, raw_head, stream

pytestmark = pytest.mark.slow

BIG = {**GREEDY, "prompt": list(range(1000, 1300)), "echo": True, "logprobs": 20}
"""A stream far larger than a small socket buffer for little engine work: its first
event echoes a 300-token prompt with 20 alternatives a token (some 170 kB)."""
OTHERS = 2


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response's bytes after its head."""
    out, rest = b"", data
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def test_a_client_that_does_not_read_stalls_no_other_stream(
    fault_server: LocalServer, greedy_text: str
):
    server = fault_server
    server.wait_idle()
    body = json.dumps({**BIG, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.settimeout(120)
    try:
        sock.connect(address(server))
        sock.sendall(raw_head(server, "/v1/completions", len(body)) + body)
        # While that client reads nothing, other streams run from start to end.
        for _ in range(OTHERS):
            s = stream(server, GREEDY)
            assert s.done and s.text == greedy_text and s.finish_reasons == ["length"]
        # The engine finished the slow client's request too: it never waited for the client.
        engine = server.engine
        _wait(lambda: not engine.engine.has_unfinished_requests())
        # Now the client reads: everything arrives, in order, whole.
        window = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    finally:
        sock.close()
    # Far more than the client's buffer held: the server had to keep the rest while the
    # client did not read (else this test would not have tested a slow reader).
    assert len(data) > 10 * window, (len(data), window)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = [
        line[6:] for line in _dechunk(rest).decode().splitlines() if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    ends = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"])
    assert ends == [0] and chunks[0]["choices"][0]["logprobs"]["top_logprobs"][1]
    gauges = server.wait_idle()
    assert gauges == dict.fromkeys(gauges, 0.0)


def _wait(cond, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
