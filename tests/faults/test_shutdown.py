"""SIGTERM to the whole process group of the one-process server (``iterserve serve``
without Ray) drains it: a stream still open at the end of the grace period ends with an
error event and ``[DONE]``, and the server exits 0 within the grace period.

The Ray Serve path's shutdown is tested on the fault suite's Ray server, which it stops
(``tests/faults/test_replica_faults.py``): one Ray application for both.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from deploy.local_server import CUT_MARGIN_S, GRACEFUL_SHUTDOWN_S
from tests.serving_app import MODEL, free_port, start_serve, wait_ready

pytestmark = pytest.mark.slow


def test_sigterm_to_the_group_of_the_one_process_server(tmp_path):
    port = free_port()
    proc = start_serve(["--port", str(port)], tmp_path)
    log = proc.log
    try:
        wait_ready(proc)
        events: list[str] = []
        body = {
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }

        def read() -> None:
            url = f"http://127.0.0.1:{port}/v1/completions"
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 180
        while len(events) < 3:
            assert reader.is_alive() and time.monotonic() < deadline, events
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        start = time.monotonic()
        code = proc.wait(timeout=GRACEFUL_SHUTDOWN_S + CUT_MARGIN_S + 10)
        took = time.monotonic() - start
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, log.read_text()[-3000:]
    assert took < GRACEFUL_SHUTDOWN_S + CUT_MARGIN_S, took
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "replica_lost", events[-2]
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
