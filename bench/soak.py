"""Soak: mixed traffic with hang-ups, malformed requests and one replica killed, on a
2-replica Ray Serve application, watching memory, KV and gauges for growth or loss.

    python -m bench.soak --minutes 30        # about 33 minutes (printed first)

1. ``iterserve serve`` with two replicas (one CPU each) on an embedded Ray cluster; a
   greedy reference answer is taken once it is up.
2. ``CLIENTS`` closed-loop clients send, for ``--minutes``: streamed and non-streamed
   completions and chat completions (random lengths), a share that their clients hang up
   on (mid-stream, or while waiting for a whole answer), and a share of malformed
   requests. Halfway, one replica's process is killed (SIGKILL); Ray Serve replaces it.
3. Every ``SAMPLE_S``: each server process's RSS (the server and every process under it,
   Ray's included), ``/health`` (replicas, their KV usage and queues) and the
   ``/metrics`` gauges.
4. After the traffic, the server must drain to idle.

It fails (exit status 1) on:

- a lost request: every request must end 200 with a whole answer (a stream: a finish
  reason and ``[DONE]``, no error event), 429 with ``Retry-After``, the client's own
  hang-up, or a 4xx for a malformed one. Anything else (a 5xx, a stream ending in an
  error event, a dropped connection) is lost;
- the gauges (running, waiting, held) or any replica's KV usage not back to 0, or its free
  KV blocks not back to the count at the start, once drained;
- a greedy answer after the run that differs from the one before;
- memory growth beyond noise: over the last :data:`RSS_WINDOW` of the traffic, each process
  alive throughout it gets a least-squares line through its RSS samples; the growth that
  line gives over the window must stay under ``max(RSS_NOISE_MIB, RSS_NOISE_SHARE`` of its
  RSS). The window starts no earlier than ``WARM_S`` after the replacement replica is up,
  so its start-up growth (weights, first batch shapes) is not read as a leak; the bound is
  above what the allocators' arenas and torch's caches move by between samples, and below
  what a leak of a few kB per request adds over thousands of requests. Each process is
  also judged, with the same bound, from :data:`SETTLE_S` after it was first seen to the
  traffic's end: a slow leak over a long run does not hide in its last part.

Prints the RSS of every process at every :data:`TABLE_EVERY_S` of the run.

Writes ``bench/results/soak.json``, ``soak.png`` and ``soak_rss.png`` (each process's
RSS since it settled) (``--out`` elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from bench.toolkit import RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.prompts import corpus_text
from bench.toolkit.servers import MODEL_NAME
from deploy.top import scrape, totals

CORPUS = corpus_text()

CLIENTS = 6
"""Closed-loop clients: enough to keep both replicas' batches busy and queues forming."""
SAMPLE_S = 3.0
STREAM_SHARE = 0.5
CHAT_SHARE = 0.3
HANG_UP_SHARE = 0.15
MALFORMED_SHARE = 0.05
MAX_TOKENS = (8, 48)
PROMPT_CHARS = (40, 600)
RSS_WINDOW = 0.4
"""The share of the traffic phase, at its end, over which memory growth is judged."""
WARM_S = 30.0
"""Seconds a replacement replica gets to warm up before its memory is judged."""
RSS_NOISE_MIB = 24.0
RSS_NOISE_SHARE = 0.03
SETTLE_S = 180.0
"""Seconds from a process's first sample (or the traffic's start) after which its whole
remaining run is also judged (:func:`rss_since_settled`), with the same bound."""
TABLE_EVERY_S = 600.0
"""The spacing of the per-process RSS table (:func:`rss_every`)."""
START_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 120.0
GAUGES = (
    "iterserve:num_requests_running",
    "iterserve:num_requests_waiting",
    "iterserve:num_requests_held",
)
GREEDY = {
    "model": MODEL_NAME,
    "prompt": "The capital of France is",
    "max_tokens": 16,
    "temperature": 0,
    "ignore_eos": True,
}
MALFORMED = (
    b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": ',
    b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "x", "temperature": NaN}',
    b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "\xff\xfe"}',
    b'{"model": "no-such-model", "prompt": "x"}',
    b"[1, 2, 3]",
)


@dataclass
class Outcome:
    """How one request ended: ``ok``, ``refused`` (429 with Retry-After), ``hung_up`` (by
    its client, deliberately), ``rejected`` (a 4xx for a malformed request) or ``lost``."""

    t: float
    kind: str
    what: str
    """The request's kind (``stream``, ``chat-stream``, ``malformed``, ...)."""
    detail: str = ""


@dataclass
class Run:
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    kill: dict[str, Any] | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def count(self) -> dict[str, int]:
        kinds = ("ok", "refused", "hung_up", "rejected", "lost")
        return {k: sum(o.kind == k for o in self.outcomes) for k in kinds}


# -- the server -----------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SoakServer:
    """``iterserve serve`` with two replicas on Ray Serve, for a ``with`` block."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = tempfile.TemporaryDirectory(prefix="soak-")
        self.config = {
            "num_replicas": 2,
            "replica_num_cpus": 1,
            "port": self.port,
            "engine": {"max_num_seqs": 16},
        }
        cfg = Path(self._tmp.name) / "service.yaml"
        cfg.write_text(yaml.safe_dump(self.config))
        self.log = Path(self._tmp.name) / "server.log"
        self.command = [
            str(Path(sys.executable).parent / "iterserve"),
            "serve",
            "--config",
            str(cfg),
        ]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SoakServer:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited at start:\n{self.tail()}")
            try:
                h = httpx.get(f"{self.url}/health", timeout=5)
                if h.status_code == 200 and len(h.json()["replicas"]) >= 2:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"two replicas not healthy after {START_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            tree = self.processes()
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
            for p in tree:  # Ray's processes are under it, not in its session
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait()
        self._tmp.cleanup()

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text()[-n:]

    def processes(self) -> list[psutil.Process]:
        """The server's process and every process under it (Ray's too)."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rss(self) -> dict[str, dict[str, Any]]:
        """RSS in MiB of each live process, by pid, with its role."""
        out = {}
        for p in self.processes():
            try:
                out[str(p.pid)] = {
                    "role": "server" if p.pid == self.proc.pid else _role(p.cmdline()),
                    "rss_mib": p.memory_info().rss / 2**20,
                }
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def kill_replica(self) -> dict[str, Any]:
        """SIGKILL one model replica's process."""
        for p in self.processes():
            try:
                if _role(p.cmdline()) == "replica":
                    p.send_signal(signal.SIGKILL)
                    return {"pid": p.pid}
            except psutil.NoSuchProcess:
                continue
        raise RuntimeError("no replica process found")


def _role(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    for needle, role in (
        ("ModelReplica", "replica"),
        ("ServeController", "controller"),
        ("ServeReplica", "ingress"),
        ("ProxyActor", "proxy"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs"),
    ):
        if needle in line:
            return role
    return "ray-other"


# -- traffic ------------------------------------------------------------------------------


def _body(rng: random.Random, chat: bool, stream: bool) -> dict[str, Any]:
    n = rng.randint(*PROMPT_CHARS)
    start = rng.randrange(len(CORPUS) - n)
    text = CORPUS[start : start + n]
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": rng.randint(*MAX_TOKENS),
        "temperature": rng.choice((0.0, 0.8)),
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def _request(c: httpx.AsyncClient, run: Run, rng: random.Random) -> None:
    """One request of a random kind, its outcome appended to ``run``."""
    t = run.now()
    roll = rng.random()
    if roll < MALFORMED_SHARE:
        body = rng.choice(MALFORMED)
        try:
            r = await c.post(
                "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )
            kind = "rejected" if 400 <= r.status_code < 500 else "lost"
            detail = f"{r.status_code}" if kind == "lost" else ""
        except httpx.HTTPError as e:
            kind, detail = "lost", f"{type(e).__name__}: {e}"
        run.outcomes.append(Outcome(t, kind, "malformed", detail))
        return
    hang_up = roll < MALFORMED_SHARE + HANG_UP_SHARE
    chat, stream = rng.random() < CHAT_SHARE, rng.random() < STREAM_SHARE
    what = ("chat-" if chat else "") + ("stream" if stream else "whole")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(rng, chat, stream)
    try:
        if hang_up:
            await _hang_up(c, path, body, rng)
            run.outcomes.append(Outcome(t, "hung_up", what))
            return
        async with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                refused = r.status_code == 429 and r.headers.get("retry-after")
                run.outcomes.append(
                    Outcome(t, "refused" if refused else "lost", what, f"{r.status_code} {r.text}")
                )
                return
            if stream:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                error = next((x for x in lines if '"error"' in x[:20]), None)
                whole = (
                    lines
                    and lines[-1] == "data: [DONE]"
                    and '"finish_reason": "' in ("".join(lines[-4:]))
                )
                ok = whole and error is None
                detail = "" if ok else (error or f"ended without a finish: {lines[-2:]}")
            else:
                data = json.loads(await r.aread())
                ok = all(ch.get("finish_reason") for ch in data["choices"])
                detail = "" if ok else json.dumps(data)[:300]
        run.outcomes.append(Outcome(t, "ok" if ok else "lost", what, detail))
    except (httpx.HTTPError, ValueError) as e:
        run.outcomes.append(Outcome(t, "lost", what, f"{type(e).__name__}: {e}"))


async def _hang_up(c: httpx.AsyncClient, path: str, body: dict, rng: random.Random) -> None:
    """Send ``body`` and hang up: mid-stream after a few events, or while waiting."""
    if body["stream"]:
        events = rng.randint(0, 3)
        async with c.stream("POST", path, json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= events:
                    break
        return  # leaving the block closes the connection
    try:
        await asyncio.wait_for(c.post(path, json=body), timeout=rng.uniform(0.2, 1.5))
    except TimeoutError:
        pass


async def _client(url: str, run: Run, stop_at: float, seed: int) -> None:
    rng = random.Random(seed)
    while run.now() < stop_at:
        # A client of its own per request: a hang-up closes its connection, as a real
        # client's does, and nothing is pooled across requests.
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            await _request(c, run, rng)
        await asyncio.sleep(rng.uniform(0.0, 0.3))


# -- sampling -------------------------------------------------------------------------------


def _gauges(url: str) -> dict[str, float]:
    return totals(scrape(url, timeout_s=10), GAUGES)


def _sample(server: SoakServer, run: Run) -> dict[str, Any]:
    s: dict[str, Any] = {"t": run.now(), "rss": server.rss(), **run.count()}
    try:
        h = httpx.get(f"{server.url}/health", timeout=10)
        s["health"] = h.status_code
        s["replicas"] = h.json().get("replicas", []) if h.status_code == 200 else []
        s["gauges"] = _gauges(server.url)
    except (httpx.HTTPError, ValueError) as e:
        s["health"], s["replicas"], s["gauges"] = str(e), [], {}
    return s


async def _sampler(server: SoakServer, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        run.samples.append(await asyncio.to_thread(_sample, server, run))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def _traffic(server: SoakServer, run: Run, seconds: float, seed: int) -> None:
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sampler(server, run, stop))
    clients = [
        asyncio.create_task(_client(server.url, run, seconds, seed * 1000 + k))
        for k in range(CLIENTS)
    ]
    await asyncio.sleep(max(0.0, seconds / 2 - run.now()))
    run.kill = {"t": run.now(), **server.kill_replica()}
    print(f"[soak] t={run.kill['t']:.0f} s: killed replica process {run.kill['pid']}", flush=True)
    await asyncio.gather(*clients)
    # Drain: sample on until idle or the drain timeout.
    deadline = run.now() + DRAIN_TIMEOUT_S
    while run.now() < deadline:
        await asyncio.sleep(SAMPLE_S)
        last = run.samples[-1] if run.samples else {}
        if _idle(last) and len(last.get("replicas", [])) >= 2:
            break
    stop.set()
    await sampler
    run.samples.append(_sample(server, run))


def _idle(s: dict[str, Any]) -> bool:
    return (
        s.get("health") == 200
        and not any(s.get("gauges", {}).values())
        and all(
            r["running"] == 0 and r["waiting"] == 0 and r["kv_usage"] == 0
            for r in s.get("replicas", [])
        )
    )


# -- verdict --------------------------------------------------------------------------------


def rss_window(run: Run, traffic_s: float) -> tuple[float, float]:
    """``(start, end)`` s of the window memory growth is judged over: the last
    :data:`RSS_WINDOW` of the traffic, but no earlier than :data:`WARM_S` after both
    replicas were back from the kill (a replacement's start-up is not a leak)."""
    start = traffic_s * (1 - RSS_WINDOW)
    if run.kill is not None:
        back = next(
            (
                s["t"]
                for s in run.samples
                if s["t"] > run.kill["t"] and len(s.get("replicas", [])) >= 2
            ),
            traffic_s,
        )
        start = max(start, back + WARM_S)
    return start, traffic_s


def rss_growth(run: Run, traffic_s: float) -> dict[str, dict[str, float]]:
    """Per process alive throughout :func:`rss_window`: its RSS at the window's start,
    the growth its least-squares line gives over the window (MiB), and the bound. Empty
    when the window holds fewer than 3 samples (a short trial)."""
    start, end = rss_window(run, traffic_s)
    window = [s for s in run.samples if start <= s["t"] <= end]
    if len(window) < 3:
        return {}
    out = {}
    for pid, first in window[0]["rss"].items():
        if not all(pid in s["rss"] for s in window):
            continue
        growth = _growth(window, pid)
        bound = max(RSS_NOISE_MIB, RSS_NOISE_SHARE * first["rss_mib"])
        out[pid] = {
            "role": first["role"],
            "rss_mib": first["rss_mib"],
            "growth_mib": growth,
            "bound_mib": bound,
        }
    return out


def _growth(samples: list[dict[str, Any]], pid: str) -> float:
    """The growth (MiB) that a least-squares line through ``pid``'s RSS gives over
    ``samples``."""
    ts = [s["t"] for s in samples]
    ys = [s["rss"][pid]["rss_mib"] for s in samples]
    tm, ym = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - tm) ** 2 for t in ts)
    slope = sum((t - tm) * (y - ym) for t, y in zip(ts, ys)) / var if var else 0.0
    return slope * (ts[-1] - ts[0])


def rss_since_settled(run: Run, traffic_s: float) -> dict[str, dict[str, float]]:
    """Per process: the growth its least-squares line gives from :data:`SETTLE_S` after
    it was first seen (or after the traffic started) to the traffic's end, and the bound
    (as :func:`rss_growth`'s). Processes with fewer than 3 samples there are left out."""
    out = {}
    pids = {pid for s in run.samples for pid in s["rss"]}
    for pid in pids:
        seen = [s for s in run.samples if pid in s["rss"] and s["t"] <= traffic_s]
        if not seen:
            continue
        start = max(seen[0]["t"], 0.0) + SETTLE_S
        window = [s for s in seen if s["t"] >= start]
        if len(window) < 3 or window[-1]["t"] < traffic_s - 2 * SAMPLE_S:
            continue  # too short, or gone before the end (the killed replica)
        first = window[0]["rss"][pid]
        out[pid] = {
            "role": first["role"],
            "from_s": window[0]["t"],
            "rss_mib": first["rss_mib"],
            "growth_mib": _growth(window, pid),
            "bound_mib": max(RSS_NOISE_MIB, RSS_NOISE_SHARE * first["rss_mib"]),
        }
    return out


def rss_every(run: Run) -> list[dict[str, Any]]:
    """Each process's RSS (MiB) at every :data:`TABLE_EVERY_S` of the run (the sample
    nearest each mark), and at its last sample."""
    marks, t = [], 0.0
    end = run.samples[-1]["t"] if run.samples else 0.0
    while t <= end:
        marks.append(t)
        t += TABLE_EVERY_S
    picks = [min(run.samples, key=lambda s, m=m: abs(s["t"] - m)) for m in marks]
    if run.samples and picks[-1] is not run.samples[-1]:
        picks.append(run.samples[-1])
    return [
        {"t": p["t"], "rss": {pid: (v["role"], v["rss_mib"]) for pid, v in p["rss"].items()}}
        for p in picks
    ]


def verdict(
    run: Run, traffic_s: float, greedy: tuple[str, str], kv_free: int
) -> tuple[bool, list[str]]:
    """Whether the soak passed, and why not."""
    why = []
    lost = [o for o in run.outcomes if o.kind == "lost"]
    if lost:
        why.append(f"{len(lost)} lost requests (first: {lost[0].what}: {lost[0].detail[:200]})")
    last = run.samples[-1]
    if not _idle(last):
        why.append(f"not idle after the drain: gauges {last.get('gauges')}, {last.get('replicas')}")
    short = [r for r in last.get("replicas", []) if r["num_kv_blocks_free"] != kv_free]
    if short:
        why.append(f"KV blocks not back to {kv_free} free: {short}")
    if len(last.get("replicas", [])) < 2:
        why.append(f"{len(last.get('replicas', []))} replicas at the end, not 2")
    if greedy[0] != greedy[1]:
        why.append(f"greedy answer changed: {greedy[0]!r} -> {greedy[1]!r}")
    growth = rss_growth(run, traffic_s)
    if not growth:
        why.append("memory not judged: the window after the replacement's warm-up is too short")
    for pid, g in growth.items():
        if g["growth_mib"] > g["bound_mib"]:
            why.append(
                f"{g['role']} {pid}: RSS grew {g['growth_mib']:.1f} MiB over the window "
                f"(bound {g['bound_mib']:.1f})"
            )
    for pid, g in rss_since_settled(run, traffic_s).items():
        if g["growth_mib"] > g["bound_mib"]:
            why.append(
                f"{g['role']} {pid}: RSS grew {g['growth_mib']:.1f} MiB from "
                f"{g['from_s']:.0f} s to the traffic's end (bound {g['bound_mib']:.1f})"
            )
    if not run.outcomes or not any(o.kind == "ok" for o in run.outcomes):
        why.append("no request succeeded")
    return not why, why


# -- report ---------------------------------------------------------------------------------


def plot(run: Run, traffic_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_kv, ax_req) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    ts = [s["t"] for s in run.samples]
    roles: dict[str, list[float]] = {}
    for s in run.samples:
        for role in {p["role"] for p in s["rss"].values()} | set(roles):
            roles.setdefault(role, [])
    for role in sorted(roles):
        ys = [
            sum(p["rss_mib"] for p in s["rss"].values() if p["role"] == role) for s in run.samples
        ]
        ax_rss.plot(ts, ys, label=role)
    ax_rss.set_ylabel("RSS (MiB), summed by role")
    ax_rss.legend(fontsize=8, ncol=4)
    kv = [max((r["kv_usage"] for r in s.get("replicas", [])), default=0) for s in run.samples]
    ax_kv.plot(ts, kv, label="max replica KV usage", color="k")
    ax_kv.set_ylabel("KV usage (0-1)")
    ax_g = ax_kv.twinx()
    for name in GAUGES:
        ax_g.plot(
            ts,
            [s.get("gauges", {}).get(name, 0) for s in run.samples],
            label=name.split(":")[1],
            alpha=0.7,
        )
    ax_g.set_ylabel("requests")
    ax_g.legend(fontsize=8, loc="upper right")
    for kind in ("ok", "refused", "hung_up", "rejected", "lost"):
        ax_req.plot(ts, [s[kind] for s in run.samples], label=kind)
    ax_req.set_ylabel("requests ended (cumulative)")
    ax_req.set_xlabel("seconds")
    ax_req.legend(fontsize=8)
    for ax in (ax_rss, ax_kv, ax_req):
        if run.kill:
            ax.axvline(run.kill["t"], color="r", ls="--", lw=1)
        ax.axvline(traffic_s, color="grey", ls=":", lw=1)
        ax.axvspan(*rss_window(run, traffic_s), color="grey", alpha=0.08)
    fig.suptitle("iterserve soak: 2 replicas on Ray Serve, one killed (red line)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_settled(run: Run, traffic_s: float, path: Path) -> None:
    """Each replica's and the ingress's RSS from when it settled to the traffic's end, less
    its RSS then (:func:`rss_since_settled`), against the bound of growth (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    settled = rss_since_settled(run, traffic_s)
    for pid, g in sorted(settled.items(), key=lambda x: (x[1]["role"], x[0])):
        if g["role"] not in ("replica", "ingress", "server"):
            continue
        pts = [
            (s["t"], s["rss"][pid]["rss_mib"])
            for s in run.samples
            if pid in s["rss"] and g["from_s"] <= s["t"] <= traffic_s
        ]
        ax.plot(
            [t / 60 for t, _ in pts],
            [r - g["rss_mib"] for _, r in pts],
            label=f"{g['role']} {pid} (from {g['rss_mib']:.0f} MiB)",
        )
        ax.axhline(g["bound_mib"], ls="--", lw=0.8, color=ax.lines[-1].get_color())
    if run.kill:
        ax.axvline(run.kill["t"] / 60, color="r", ls="--", lw=1)
    ax.axvline(SETTLE_S / 60, color="grey", ls=":", lw=1)
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS since settled (MiB)")
    ax.legend(fontsize=8)
    ax.set_title("RSS per process after settling; dashed: the bound on growth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(run: Run, traffic_s: float) -> str:
    rows = []
    step = max(1, len(run.samples) // 12)
    for s in run.samples[::step] + run.samples[-1:]:
        rss = sum(p["rss_mib"] for p in s["rss"].values())
        kv = max((r["kv_usage"] for r in s.get("replicas", [])), default=0.0)
        g = s.get("gauges", {})
        rows.append(
            [
                f"{s['t']:.0f}",
                f"{rss:.0f}",
                str(len(s.get("replicas", []))),
                rp.pct(kv),
                *(f"{g.get(n, 0):.0f}" for n in GAUGES),
                *(str(s[k]) for k in ("ok", "refused", "hung_up", "rejected", "lost")),
            ]
        )
    header = ["t s", "RSS MiB", "replicas", "KV", "running", "waiting", "held"]
    return rp.table(header + ["ok", "429", "hung up", "4xx", "lost"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("bench.soak", __doc__)
    ap.add_argument("--minutes", type=float, default=10.0, help="of traffic (at least 1)")
    cli.add_seed(ap)
    cli.add_out(ap, RESULTS, "where soak.json/.png go", type=Path)
    args = ap.parse_args(argv)
    if args.minutes < 1:
        ap.error("--minutes must be at least 1")
    traffic_s = args.minutes * 60
    cli.expected("soak", traffic_s + 180, f"{args.minutes:g} min of traffic, start-up and drain")
    run = Run()
    with SoakServer() as server:
        print(f"[soak] server up at {server.url} (pid {server.proc.pid})", flush=True)
        before = httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=300).json()
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        kv_free = max(r["num_kv_blocks_free"] for r in health["replicas"])
        run = Run()
        asyncio.run(_traffic(server, run, traffic_s, args.seed))
        after = httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=300).json()
        greedy = (before["choices"][0]["text"], after["choices"][0]["text"])
        ok, why = verdict(run, traffic_s, greedy, kv_free)
        log_tail = server.tail() if not ok else ""
    print(_table(run, traffic_s))
    print(f"[soak] outcomes: {run.count()}")
    growth = rss_growth(run, traffic_s)
    print(
        rp.table(
            ["pid", "role", "RSS MiB", "growth MiB", "bound MiB"],
            [
                [
                    pid,
                    g["role"],
                    f"{g['rss_mib']:.0f}",
                    f"{g['growth_mib']:.1f}",
                    f"{g['bound_mib']:.0f}",
                ]
                for pid, g in sorted(growth.items(), key=lambda x: x[1]["role"])
            ],
        )
    )
    settled = rss_since_settled(run, traffic_s)
    print(
        rp.table(
            ["pid", "role", "from s", "RSS MiB", "growth to the end MiB", "bound MiB"],
            [
                [
                    pid,
                    g["role"],
                    f"{g['from_s']:.0f}",
                    f"{g['rss_mib']:.0f}",
                    f"{g['growth_mib']:.1f}",
                    f"{g['bound_mib']:.0f}",
                ]
                for pid, g in sorted(settled.items(), key=lambda x: x[1]["role"])
            ],
        )
    )
    every = rss_every(run)
    pids = sorted({pid for row in every for pid in row["rss"]})
    roles = {pid: role for row in every for pid, (role, _) in row["rss"].items()}
    print(
        rp.table(
            ["t s", *(f"{roles[p]} {p}" for p in pids)],
            [
                [
                    f"{row['t']:.0f}",
                    *(f"{row['rss'][p][1]:.0f}" if p in row["rss"] else "-" for p in pids),
                ]
                for row in every
            ],
        )
    )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(run, traffic_s, args.out / "soak.png")
    plot_settled(run, traffic_s, args.out / "soak_rss.png")
    rp.write_report(
        args.out / "soak.json",
        {
            "config": {
                "service": server.config,
                "clients": CLIENTS,
                "minutes": args.minutes,
                "seed": args.seed,
                "shares": {
                    "stream": STREAM_SHARE,
                    "chat": CHAT_SHARE,
                    "hang_up": HANG_UP_SHARE,
                    "malformed": MALFORMED_SHARE,
                },
                "rss_window": RSS_WINDOW,
                "rss_noise_mib": RSS_NOISE_MIB,
                "rss_noise_share": RSS_NOISE_SHARE,
            },
            "passed": ok,
            "failures": why,
            "outcomes": run.count(),
            "lost": [asdict(o) for o in run.outcomes if o.kind == "lost"],
            "kill": run.kill,
            "greedy": {"before": greedy[0], "after": greedy[1]},
            "kv_blocks_free_at_start": kv_free,
            "rss_growth": growth,
            "rss_since_settled": settled,
            "settle_s": SETTLE_S,
            "rss_every": every,
            "samples": run.samples,
        },
    )
    if ok:
        print("[soak] PASSED")
        return 0
    print("[soak] FAILED:\n  " + "\n  ".join(why))
    if log_tail:
        print("[soak] server log tail:\n" + log_tail[-1500:])
    return 1


if __name__ == "__main__":
    sys.exit(main())
