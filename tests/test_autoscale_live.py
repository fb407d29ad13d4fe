"""``iterserve serve`` autoscaling between 1 and 2 replicas (1 CPU each) on Ray Serve: a load
step that one replica cannot hold scales the fleet up to 2 running replicas, and it comes
back to 1 once the load stops, while long requests go on; every request meanwhile gets 200
with a whole stream or 429 with a Retry-After.

Short settings (decisions every second over a 4 s window) so that it runs in a minute or
two; it asserts that the events happen, polling with generous deadlines, not when."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import httpx
import pytest

pytest.importorskip("ray")

from deploy.config import ServiceConfig  # noqa: E402
from tests.conftest import CORPUS  # noqa: E402
from tests.serving_app import MODEL, free_port, health, running_command  # noqa: E402

pytestmark = pytest.mark.slow


class Load:
    """``workers`` clients streaming completions of ``max_tokens`` back to back until
    :meth:`stop`; a 429 is retried after its Retry-After (at most a second)."""

    def __init__(
        self, url: str, workers: int, max_tokens: int, traffic_class: str = "standard"
    ) -> None:
        self.url, self.max_tokens, self.traffic_class = url, max_tokens, traffic_class
        self.outcomes: list[str] = []
        """Per request: ``ok`` (200 and a whole stream), ``429`` (with Retry-After), or
        what went wrong."""
        self.served: list[tuple[str, float, float]] = []
        """Per request answered 200: its replica, and when it started and ended
        (monotonic seconds)."""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,)) for k in range(workers)]
        for t in self._threads:
            t.start()

    def _client(self, k: int) -> None:
        with httpx.Client(timeout=120) as c:
            n = 0
            while not self._stop.is_set():
                n += 1
                start = (k * 997 + n * 131) % (len(CORPUS) // 2)  # no two prompts alike
                body = {
                    "model": MODEL,
                    "prompt": CORPUS[start : start + 1800],
                    "max_tokens": self.max_tokens,
                    "stream": True,
                }
                self.outcomes.append(self._one(c, body))

    @property
    def replicas(self) -> set[str]:
        """The replicas that served its requests."""
        return {replica for replica, _, _ in self.served}

    def _one(self, c: httpx.Client, body: dict) -> str:
        headers = {"x-iterserve-class": self.traffic_class}
        start = time.monotonic()
        with c.stream("POST", f"{self.url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code == 429:
                r.read()
                retry = r.headers.get("retry-after")
                if retry is None or not retry.isdigit():
                    return f"429 without Retry-After: {r.headers}"
                time.sleep(min(1.0, float(retry)))
                return "429"
            if r.status_code != 200:
                return f"{r.status_code}: {r.read()[:300]!r}"
            lines = [line for line in r.iter_lines() if line]
            self.served.append((r.headers["x-iterserve-replica"], start, time.monotonic()))
            if lines[-1:] != ["data: [DONE]"] or any('"error"' in line for line in lines):
                return f"broken stream: {lines[-3:]}"
            return "ok"

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def target(url: str) -> float:
    """``iterserve:num_replicas_target`` now."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^iterserve:num_replicas_target\{[^}]*\} (\S+)$", text, re.M)[1])


def wait_for(what: str, done: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``done()``; fails after ``timeout_s``."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < timeout_s, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_a_load_step_scales_up_to_two_replicas_and_back_to_one(tmp_path):
    config = ServiceConfig(
        num_replicas="auto",
        replica_num_cpus=1,
        port=free_port(),
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "decision_period_s": 1,
            "window_s": 4,
            "scale_down_delay_s": 10,
            "replica_start_s": 1,
        },
        engine={"max_num_seqs": 8, "traffic_classes": {"standard": {"tpot_slo_s": 0.25}}},
    )
    url = f"http://127.0.0.1:{config.port}"
    with running_command(config, tmp_path) as proc:
        assert health(url)["num_replicas"] == 1 and target(url) == 1
        load = Load(url, workers=8, max_tokens=32)
        try:
            # The second replica starts while the first serves (a model load on a busy
            # host): the load goes on until it serves.
            up_s = wait_for("second running replica", lambda: health(url)["num_replicas"] == 2, 240)
            assert target(url) == 2
        finally:
            load.stop()
        # The fleet shrinks under a trickle of long batch requests (a class that may
        # wait, so they do not hold it at two): the replica scaled down finishes the
        # ones it holds before it stops.
        trickle = Load(url, workers=2, max_tokens=96, traffic_class="batch")
        try:
            down_s = wait_for(
                "scale-down to one replica",
                lambda: health(url)["num_replicas"] == 1 and target(url) == 1,
                180,
            )
            down_at = time.monotonic()
        finally:
            trickle.stop()
        h = health(url)
        kept = {r["replica"] for r in h["replicas"]}
        # Informative only: the long requests that were on the replica scaled down as it
        # went (routing decides where they ran; a cut one is a broken stream, below).
        drained = [
            f"{end - down_at:+.1f} s"
            for r, start, end in trickle.served
            if r not in kept and start < down_at < end
        ]
        scaled = h["autoscaling"]
        assert scaled["target"] == 1 and scaled["reason"]
        decisions = [
            line.split("iterserve.autoscale: ", 1)[1]
            for line in proc.log.read_text().splitlines()
            if "iterserve.autoscale: target" in line
        ]
    served = sorted(load.replicas | trickle.replicas)
    print(f"up after {up_s:.0f} s of load, down {down_s:.0f} s after it; served by {served}")
    print(f"long requests on the replica scaled down, ending after it went: {drained}")
    print(*decisions, sep="\n")
    assert any(d.startswith("target 2 ") and d.endswith(": +1") for d in decisions), decisions
    assert any(d.startswith("target 1 ") and d.endswith(": -1") for d in decisions), decisions
    for run in (load, trickle):
        bad = [o for o in run.outcomes if o not in ("ok", "429")]
        assert not bad and "ok" in run.outcomes, (run.traffic_class, bad[:5], len(run.outcomes))
