"""Replica faults on Ray Serve under live greedy streams, against one ``iterserve serve
--num-replicas 2`` started as a user starts it (in its own session, short health checks).

In order, on the same server: a replica SIGKILLed mid-stream loses no stream (every stream
completes with the text and usage of an uninterrupted run, and ``/health`` lists exactly
the live replicas soon after); a replica stopped with SIGSTOP is taken out and its streams
complete elsewhere; SIGTERM to the server's process group drains and exits 0, ending a
stream still open with an error event and ``[DONE]``. ``python -m bench.failover`` runs
the first two with more streams and measures the pauses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
if not Path("/proc/self/fd").is_dir():
    pytest.skip("finds the replicas' processes in /proc (Linux)", allow_module_level=True)

from bench.failover import (  # noqa: E402
    FaultRun,
    fault_run,
    listed,
    prompts,
    references,
    wait_replicas,
)
from deploy.config import ServiceConfig  # noqa: E402
from tests.serving_app import MODEL, free_port, start_serve, wait_ready  # noqa: E402

pytestmark = pytest.mark.slow

STREAMS = 8
MAX_TOKENS = 40
AFTER_TOKENS = 8
"""Tokens every stream has streamed before the fault."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``iterserve serve`` with 2 replicas; yields ``(url, process)``. The last test
    stops it; if it did not, it is killed here."""
    tmp = tmp_path_factory.mktemp("faults")
    config = ServiceConfig(
        num_replicas=2,
        replica_num_cpus=1,
        port=free_port(),
        health_check_period_s=1.0,
        health_check_timeout_s=3.0,
        engine={"max_num_seqs": STREAMS, "num_kv_blocks": 256},
    )
    proc = start_serve(config, tmp)
    try:
        wait_ready(proc, timeout_s=240)
        url = f"http://{config.host}:{config.port}"
        wait_replicas(url, 2, timeout_s=60)
        yield url, proc
    finally:
        if proc.poll() is None:
            _kill_tree(proc)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (``/proc``), children first."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the server and every process under it (Ray's are in another session)."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def replica_pid(proc: subprocess.Popen, unique_id: str) -> int:
    """The pid of the server's Serve replica ``unique_id``: the process under the server
    that holds that replica's log file open (Serve names it after the replica)."""
    for pid in _descendants(proc.pid):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                if f"_{unique_id}." in os.readlink(fd):
                    return pid
            except OSError:  # closed meanwhile
                continue
    raise AssertionError(f"no process of replica {unique_id}")


@pytest.fixture(scope="module")
def refs(server):
    url, _ = server
    return references(url, prompts(STREAMS), MAX_TOKENS)


def _run(server, refs, fault: str, sig: int) -> FaultRun:
    url, proc = server
    return fault_run(
        url,
        fault,
        prompts(STREAMS),
        refs,
        MAX_TOKENS,
        AFTER_TOKENS,
        lambda pid: os.kill(pid, sig),
        pid_of=lambda rid: replica_pid(proc, rid),
    )


def _assert_no_stream_lost(run: FaultRun, refs: list[dict]) -> None:
    rows = run.rows()
    assert any(r["migrated"] for r in rows)  # the fault hit streams
    for i, (r, s, ref) in enumerate(zip(rows, run.streams, refs)):
        assert r["completed"], (i, r)
        assert s.text == ref["text"], (i, s.text, ref["text"])
        assert s.usage == ref["usage"], (i, s.usage, ref["usage"])
        assert s.usage["completion_tokens"] == MAX_TOKENS


def test_a_sigkilled_replica_loses_no_stream(server, refs):
    run = _run(server, refs, "SIGKILL", signal.SIGKILL)
    _assert_no_stream_lost(run, refs)
    # /health dropped the dead replica, listing as many as it counts, well before Serve
    # could have replaced it.
    assert run.out_of_health_s is not None and run.out_of_health_s < 10, run.out_of_health_s
    assert run.health_exact
    h = wait_replicas(server[0], 2, timeout_s=240)  # Serve replaced it
    assert run.victim not in listed(h)


def test_a_sigstopped_replica_is_taken_out(server, refs):
    run = _run(server, refs, "SIGSTOP", signal.SIGSTOP)
    _assert_no_stream_lost(run, refs)
    assert run.out_of_health_s is not None
    assert run.victim not in listed(wait_replicas(server[0], 2, timeout_s=240))


def test_sigterm_to_the_process_group_drains_and_exits_0(server):
    """Last: it stops the server. SIGTERM to the whole group (as Ctrl-C's SIGINT in a
    terminal): open streams end with an error event and ``[DONE]``, the status is 0."""
    url, proc = server
    events: list[str] = []
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.log.read_text()[-3000:]
    reader.join(timeout=30)
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "replica_lost", events[-2]
    assert "shut down" in proc.log.read_text()
