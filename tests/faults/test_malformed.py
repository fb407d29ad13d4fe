"""Malformed traffic: every bad request gets a 4xx in OpenAI's error format, never a 5xx,
and the server is as before afterwards. A slow body holds up nobody else."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.faults.conftest import KEY, LocalServer, address, raw_head
from tests.serving_app import MODEL

pytestmark = pytest.mark.slow

M = MODEL.encode()
DEPTH = 10_000
BAD = {
    "invalid JSON": b'{"model": "' + M + b'", "prompt": ',
    "wrong types": json.dumps({"model": MODEL, "prompt": 5, "max_tokens": "many"}).encode(),
    "NaN": b'{"model": "' + M + b'", "prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"model": "' + M + b'", "prompt": "hi", "max_tokens": Infinity}',
    "-Infinity": b'{"model": "' + M + b'", "prompt": "hi", "top_p": -Infinity}',
    "overflowing float": b'{"model": "' + M + b'", "prompt": "hi", "temperature": 1e999}',
    "deep arrays": b'{"model": "' + M + b'", "prompt": ' + b"[" * DEPTH + b"]" * DEPTH + b"}",
    "deep objects": b'{"model": "'
    + M
    + b'", "prompt": '
    + b'{"a": ' * DEPTH
    + b"1"
    + b"}" * DEPTH
    + b"}",
    "invalid UTF-8": b'{"model": "' + M + b'", "prompt": "\xff\xfe\xc3"}',
    "lone surrogate": b'{"model": "' + M + b'", "prompt": "\\ud800"}',
    "empty body": b"",
    "array body": b"[1, 2, 3]",
    "string body": b'"prompt"',
    "null body": b"null",
    "unknown model": json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
    "no prompt": json.dumps({"model": MODEL}).encode(),
    "negative max_tokens": json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}).encode(),
    "huge n": json.dumps({"model": MODEL, "prompt": "hi", "n": 10**9}).encode(),
    "token id out of range": json.dumps({"model": MODEL, "prompt": [10**12]}).encode(),
    "prompt over the context": json.dumps(
        {"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1}
    ).encode(),
}
CHAT_BAD = {
    "messages not a list": json.dumps({"model": MODEL, "messages": "hi"}).encode(),
    "unknown role": json.dumps(
        {"model": MODEL, "messages": [{"role": "x", "content": "a"}]}
    ).encode(),
    "content of the wrong type": json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]}
    ).encode(),
}


def _check_4xx(r: httpx.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["message"] and error["type"], (what, r.text[:300])


def _post(server: LocalServer, path: str, content, **headers) -> httpx.Response:
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
    return httpx.post(f"{server.url}{path}", content=content, headers=h, timeout=120)


def test_malformed_requests_get_a_4xx_and_the_server_goes_on(
    fault_server: LocalServer, greedy_text: str
):
    for what, body in BAD.items():
        _check_4xx(_post(fault_server, "/v1/completions", body), what)
    for what, body in CHAT_BAD.items():
        _check_4xx(_post(fault_server, "/v1/chat/completions", body), what)
    _check_4xx(_post(fault_server, "/v1/completions", b"x" * (20 << 20)), "20 MB body")
    # The same without a declared length: a chunked body, cut off once over the limit.
    chunks = (b"x" * (1 << 20) for _ in range(20))
    _check_4xx(_post(fault_server, "/v1/completions", chunks), "20 MB chunked body")
    _check_4xx(
        _post(fault_server, "/v1/completions", b"model=x&prompt=y", **{"Content-Type": "x"}),
        "a form body",
    )
    assert httpx.get(f"{fault_server.url}/health", timeout=10).status_code == 200
    fault_server.wait_idle()
    r = fault_server.complete()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the one response on ``sock`` (``Connection: close``)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_a_slow_body_holds_up_nobody(fault_server: LocalServer, greedy_text: str):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "soon"}).encode()
    with socket.create_connection(address(fault_server), timeout=120) as sock:
        sock.sendall(raw_head(fault_server, "/v1/completions", len(body)))
        half = len(body) // 2
        for i in range(half):  # byte by byte
            sock.sendall(body[i : i + 1])
            time.sleep(0.005)
        # Half the body is in, the rest to come: the server serves everyone else meanwhile.
        assert httpx.get(f"{fault_server.url}/health", timeout=10).status_code == 200
        r = fault_server.complete()
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy_text
        sock.sendall(body[half:])
        status, answer = _read_response(sock)
    assert status == 400 and json.loads(answer)["error"]["param"] == "max_tokens", answer
    # A client that stops halfway through its body and hangs up leaves nothing behind.
    with socket.create_connection(address(fault_server), timeout=120) as sock:
        sock.sendall(raw_head(fault_server, "/v1/completions", 1000) + b'{"model": ')
        time.sleep(0.2)
    gauges = fault_server.wait_idle()
    assert gauges == dict.fromkeys(gauges, 0.0)
    assert httpx.get(f"{fault_server.url}/health", timeout=10).status_code == 200
