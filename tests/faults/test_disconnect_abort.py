"""A request nobody waits for stops: a client that leaves aborts its request (streamed or
not, on every path), and one that leaves while it sends its body is no error of ours.

The Ray Serve deployment builds its ingress without ``watch_disconnects`` (router/api.py),
as :func:`tests.faults.queue_fakes.ingress` does; the real server's side of this (the
engine request stops and frees its KV blocks) is
``tests/serving_errors.py::test_client_disconnect_aborts_and_frees_blocks``."""

from __future__ import annotations

import asyncio
import json
import logging

from router.ingress import CLIENT_GONE
from tests.faults.queue_fakes import SlowReplica, asgi_post, client_leaving, ingress, metric

BODY = json.dumps({"model": "m", "prompt": "abc", "max_tokens": 100_000}).encode()


async def test_non_streamed_request_is_aborted_when_its_client_leaves():
    """100,000 tokens would take some 20 minutes; the client leaves after 0.3 s, and the
    request stops then: answered 499, its replica stream closed, counted as aborted."""
    replica = SlowReplica(step_s=0.01)
    ing, app = ingress(replica)
    status, _, _ = await asyncio.wait_for(
        asgi_post(app, "/v1/completions", BODY, client_leaving(BODY, after_s=0.3)), timeout=30
    )
    assert status == CLIENT_GONE
    for _ in range(100):  # the abort lands at the replica stream's next await
        if replica.running == 0:
            break
        await asyncio.sleep(0.01)
    assert (replica.running, replica.aborted) == (0, 1)
    assert metric(ing, "request_aborted_total", model="m", traffic_class="standard") == 1
    assert (
        metric(
            ing,
            "request_success_total",
            model="m",
            traffic_class="standard",
            finish_reason="length",
        )
        == 0
    )


async def test_client_leaving_while_sending_its_body_is_logged_at_info(caplog):
    """Half a body, then the client is gone: 499 and one INFO line, no error and no
    traceback (it is the client's act), and nothing reached a replica."""
    replica = SlowReplica()
    _, app = ingress(replica)
    with caplog.at_level(logging.INFO, logger="router.ingress"):
        status, _, _ = await asgi_post(
            app, "/v1/completions", BODY, client_leaving(BODY, after_s=0.0, send_body=False)
        )
    assert status == CLIENT_GONE
    records = [r for r in caplog.records if r.name == "router.ingress"]
    assert [r.levelno for r in records] == [logging.INFO], records
    assert "disconnected" in records[0].getMessage() and records[0].exc_info is None
    assert replica.running == replica.aborted == 0
