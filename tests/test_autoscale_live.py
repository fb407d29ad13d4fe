"""``iterserve serve`` autoscaling between 1 and 2 replicas (1 CPU each) on Ray Serve, with the
policy's default settings: from a cold start, a light load holds one replica for two
minutes; a load step that one replica cannot hold scales the fleet up within a minute and to
2 running replicas, and it comes back to 1 once the load stops, while long requests go on;
every request meanwhile gets 200 with a whole stream or 429 with a Retry-After.

One server for both parts (its start is the slow part on a small host). The schedule is
``tests.test_autoscale.COLD_START_STEPS``, which the simulator replays there. It asserts
when the two scaling decisions came (none up before the step, one up within
``STEP_SCALES_UP_WITHIN_S`` of it, by the server's log) and that the other events happen,
polling with generous deadlines, not when."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime

import httpx
import pytest

pytest.importorskip("ray")

from deploy.config import ServiceConfig  # noqa: E402
from tests.conftest import CORPUS  # noqa: E402
from tests.serving_app import MODEL, free_port, health, running_command  # noqa: E402
from tests.test_autoscale import (  # noqa: E402
    COLD_START_OUTPUT,
    COLD_START_STEPS,
    STEP_SCALES_UP_WITHIN_S,
)

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
        outcome, retry_s = stream_one(c, self.url, body, self.traffic_class, self.served)
        time.sleep(retry_s)
        return outcome

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def stream_one(
    c: httpx.Client, url: str, body: dict, traffic_class: str, served: list
) -> tuple[str, float]:
    """One streamed completion: its outcome (``ok``: 200 and a whole stream, its replica
    and start and end times appended to ``served``; ``429`` with a Retry-After; or what
    went wrong), and the seconds its Retry-After asks a client to wait (at most 1)."""
    headers = {"x-iterserve-class": traffic_class}
    start = time.monotonic()
    with c.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code == 429:
            r.read()
            retry = r.headers.get("retry-after")
            if retry is None or not retry.isdigit():
                return f"429 without Retry-After: {r.headers}", 0.0
            return "429", min(1.0, float(retry))
        if r.status_code != 200:
            return f"{r.status_code}: {r.read()[:300]!r}", 0.0
        lines = [line for line in r.iter_lines() if line]
        served.append((r.headers["x-iterserve-replica"], start, time.monotonic()))
        if lines[-1:] != ["data: [DONE]"] or any('"error"' in line for line in lines):
            return f"broken stream: {lines[-3:]}", 0.0
        return "ok", 0.0


class Paced:
    """Open-loop load of ``standard`` requests: ``steps`` of (requests per second, seconds)
    at even intervals, the last rate on until :meth:`stop`; each request on a thread of its
    own. Prompts of about 200 tokens (900 characters), ``max_tokens`` output tokens."""

    def __init__(self, url: str, steps: Sequence[tuple[float, float]], max_tokens: int) -> None:
        self.url, self.steps, self.max_tokens = url, steps, max_tokens
        self.traffic_class = "standard"
        self.outcomes: list[str] = []
        self.served: list[tuple[str, float, float]] = []
        self.started_at = time.time()
        """Unix seconds of the first request."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pacer = threading.Thread(target=self._pace)
        self._pacer.start()

    def step_at(self, k: int) -> float:
        """Unix seconds at which step ``k`` of the schedule begins."""
        return self.started_at + sum(span for _, span in self.steps[:k])

    def _pace(self) -> None:
        start = time.monotonic()
        for n, t in enumerate(self._offsets()):
            if self._stop.wait(max(0.0, start + t - time.monotonic())):
                return
            thread = threading.Thread(target=self._request, args=(n,))
            thread.start()
            self._threads.append(thread)

    def _offsets(self) -> Iterator[float]:
        """Seconds from the first request to each request (the last rate goes on)."""
        t, end = 0.0, 0.0
        for rate, span in self.steps:
            end += span
            while t < end - 1e-9:
                yield t
                t += 1 / rate
        while True:
            yield t
            t += 1 / self.steps[-1][0]

    def _request(self, n: int) -> None:
        start = (n * 131) % (len(CORPUS) // 2)  # no two prompts alike
        body = {
            "model": MODEL,
            "prompt": CORPUS[start : start + 900],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        with httpx.Client(timeout=120) as c:
            try:
                outcome, _ = stream_one(c, self.url, body, self.traffic_class, self.served)
            except httpx.HTTPError as e:
                outcome = f"{type(e).__name__}: {e}"
        self.outcomes.append(outcome)

    @property
    def replicas(self) -> set[str]:
        return {replica for replica, _, _ in self.served}

    def stop(self) -> None:
        self._stop.set()
        self._pacer.join(timeout=10)
        for t in self._threads:
            t.join(timeout=150)


def target(url: str) -> float:
    """``iterserve:num_replicas_target`` now."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^iterserve:num_replicas_target\{[^}]*\} (\S+)$", text, re.M)[1])


def decisions(log: str) -> list[tuple[float, str]]:
    """The ``iterserve.autoscale`` decisions in a server's log: (Unix seconds, words)."""
    out = []
    for line in log.splitlines():
        m = re.search(r"(\d{4}-\d\d-\d\d [\d:]{8},\d{3}) iterserve\.autoscale: (target .*)", line)
        if m:
            at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
            out.append((at, m[2]))
    return out


def wait_for(what: str, done: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``done()``; fails after ``timeout_s``."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < timeout_s, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.5)
    return time.monotonic() - start


def test_a_cold_start_holds_a_light_load_then_a_step_scales_up_to_two_and_back_to_one(tmp_path):
    config = ServiceConfig(
        num_replicas="auto",
        replica_num_cpus=1,
        port=free_port(),
        autoscaling={"min_replicas": 1, "max_replicas": 2, "scale_down_delay_s": 10},
        engine={"max_num_seqs": 8},
    )
    url = f"http://127.0.0.1:{config.port}"
    with running_command(config, tmp_path) as proc:
        assert health(url)["num_replicas"] == 1 and target(url) == 1
        load = Paced(url, COLD_START_STEPS, COLD_START_OUTPUT)
        try:
            step_at = load.step_at(1)
            while time.time() < step_at:
                assert health(url)["num_replicas"] == 1 and target(url) == 1
                time.sleep(1.0)
            # The decision reaches the ingress a decision period or two after it is made
            # (through the replicas, then the key-value store): its log line tells when.
            wait_for("scale-up", lambda: target(url) == 2, STEP_SCALES_UP_WITHIN_S + 30)
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
        decided = decisions(proc.log.read_text())
    served = sorted(load.replicas | trickle.replicas)
    start = load.started_at
    print(f"step at +{step_at - start:.0f} s; second replica serving {up_s:.0f} s after the")
    print(f"scale-up reached the ingress; down {down_s:.0f} s after the load; served by {served}")
    print(f"long requests on the replica scaled down, ending after it went: {drained}")
    print(*(f"{at - start:+7.1f} s  {words}" for at, words in decided), sep="\n")
    ups = [at for at, words in decided if words.startswith("target 2 ") and words.endswith(": +1")]
    assert ups, decided
    assert ups[0] >= step_at, f"scaled up {ups[0] - start:.0f} s after the first request"
    assert ups[0] - step_at <= STEP_SCALES_UP_WITHIN_S, (
        f"up {ups[0] - step_at:.0f} s after the step"
    )
    assert any(w.startswith("target 1 ") and w.endswith(": -1") for _, w in decided), decided
    for run in (load, trickle):
        bad = [o for o in run.outcomes if o not in ("ok", "429")]
        assert not bad and "ok" in run.outcomes, (run.traffic_class, bad[:5], len(run.outcomes))
