"""The digital twin against a real server in this process: ``iterserve calibrate
--from-url`` and ``iterserve simulate --from-url`` read its ``GET /steps`` over HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from deploy.cli import main
from deploy.config import ServiceConfig
from engine.core.step_cost import LinearCost

KEY = "sk-twin"
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """``iterserve serve``'s one-process server (uvicorn and the engine) on a spare port,
    in a thread, with an API key; twelve requests served through it, two at a time."""
    from deploy.local_server import build_local

    port = _free_port()
    srv, replica = build_local(
        ServiceConfig(
            port=port,
            api_keys={KEY: {"tenant": "t", "traffic_class": "interactive"}},
            engine={"num_kv_blocks": 256},
        )
    )
    # uvicorn's own Server: the server's subclass installs signal handlers, which only
    # the main thread may.
    srv = uvicorn.Server(srv.config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.started, "the server did not start"

    async def load() -> list[int]:
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def one(i: int) -> int:
                r = await client.post(
                    "/v1/completions",
                    headers={**auth, "x-iterserve-class": ("interactive", "batch")[i % 2]},
                    json={
                        "model": MODEL,
                        "prompt": " ".join(["word"] * (10 + 17 * i)),
                        "max_tokens": 8 + i % 5,
                        "ignore_eos": True,
                    },
                )
                return r.status_code

            # Two at a time: at least 9 steps a pair however fast the host runs them.
            out = []
            for i in range(0, 12, 2):
                out += await asyncio.gather(one(i), one(i + 1))
            return out

    statuses = asyncio.run(load())
    assert statuses == [200] * 12
    yield url
    srv.should_exit = True
    thread.join(30)
    asyncio.run(replica.engine.shutdown())


def test_calibrate_from_url_fits_the_servers_steps(server, tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--from-url", server, "--api-key", KEY, "--output", str(out)]) == 0
    cost = LinearCost.load(out)
    assert server in cost.source
    assert cost.num_kv_blocks == 256 and cost.block_size == 16
    assert any(c > 0 for c in cost.coefficients)
    # The held-out table: the later half of the server's steps, each kind judged.
    text = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) \|", text, re.MULTILINE))
    assert int(rows["all"]) >= 10 and int(rows["decode"]) + int(rows["mixed"]) > 0


def test_simulate_from_url_replays_its_traffic_under_a_plan(server, tmp_path, capsys):
    out = tmp_path / "twin.json"
    argv = ["simulate", "--from-url", server, "--api-key", KEY, "--replicas", "2"]
    assert main([*argv, "--max-num-batched-tokens", "128", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    served, planned = report["served"], report["simulated"]
    assert served["requests"] == planned["requests"] == 12
    assert set(served["classes"]) == set(planned["classes"]) == {"interactive", "batch"}
    assert served["classes"]["interactive"]["ok"] == 6
    assert planned["classes"]["batch"]["ok"] + planned["classes"]["batch"]["refused"] == 6
    assert report["config"]["num_replicas"] == 2
    assert report["config"]["engine"]["max_num_batched_tokens"] == 128
    assert "As served" in capsys.readouterr().out


def test_the_twin_needs_the_key_and_a_reachable_server(server, tmp_path, capsys):
    assert main(["calibrate", "--from-url", server, "--output", str(tmp_path / "x.json")]) == 2
    assert "401" in capsys.readouterr().err
    dead = f"http://127.0.0.1:{_free_port()}"
    assert main(["simulate", "--from-url", dead, "--api-key", KEY]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    bad = ["simulate", "--from-url", server, "--api-key", KEY, "--rate-scale", "2"]
    assert main(bad) == 2
    assert "trace-window flags" in capsys.readouterr().err
    sweep = ["calibrate", "--from-url", server, "--steps-per-level", "5"]
    assert main([*sweep, "--output", str(tmp_path / "y.json")]) == 2
    assert "go with the sweep" in capsys.readouterr().err
