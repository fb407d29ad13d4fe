"""Replica failures under live streams on Ray Serve: a SIGKILLed replica's streams migrate,
a SIGSTOPped replica is taken out.

A 2-replica Ray Serve application (as ``iterserve serve --num-replicas 2`` runs it, on a
2-CPU embedded cluster) serves ``--streams`` greedy streams of ``--max-tokens`` tokens
each. Every prompt is first answered once, not streamed, with no fault: the reference.

1. SIGKILL: once every stream has streamed ``--kill-after`` tokens, the replica serving
   the first stream is SIGKILLed. Per stream: did it complete (``finish_reason: length``,
   no error event, ``[DONE]``), is its text the reference's, does ``usage`` count the
   whole output and the original prompt, and the pause it saw: its longest gap between
   two chunks after the kill against its median gap before it. Also the seconds until
   ``/health`` no longer listed the dead replica.
2. SIGSTOP: once both replicas run again (Serve replaced the killed one), the same with
   the replica of the first stream stopped by SIGSTOP (it can answer nothing, health
   checks included); the seconds from SIGSTOP until ``/health`` no longer listed it
   (Serve's health check declared it dead and the ingress stopped routing to it) and
   until its last stream completed elsewhere. The application runs with short health
   checks (``--health-check-period-s``, ``--health-check-timeout-s``): Serve declares a
   replica dead after three failed checks in a row.

Run from the repository root (prints its expected duration first)::

    python -m bench.failover

Writes ``bench/results/failover.json`` and ``.md``. ``tests/faults/test_replica_faults.py``
runs the same scenarios with fewer, shorter streams and asserts their outcomes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.toolkit import RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.servers import MODEL_NAME, free_port

OUT = RESULTS / "failover"
TOPICS = [
    "the sea",
    "a lighthouse",
    "a train journey",
    "a mountain village",
    "an old clock",
    "a winter market",
    "a lost letter",
    "the first snow",
    "a busy kitchen",
    "a library at night",
    "a red bicycle",
    "a summer storm",
    "a quiet harbour",
    "a desert road",
    "a city bridge",
    "an orchard",
]


def prompts(n: int) -> list[str]:
    """``n`` distinct story prompts."""
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i}):" for i in range(n)]


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    prompt: str
    replica: str = ""
    chunks: list[tuple[float, str]] = field(default_factory=list)
    """``(time.monotonic(), text)`` of every chunk with text."""
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    usage: dict | None = None
    failure: str | None = None
    """A transport error (the connection was cut), if any."""

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)

    @property
    def completed(self) -> bool:
        return self.done and self.error is None and self.finish_reason == "length"

    def pause(self, after: float) -> tuple[float | None, float | None]:
        """``(longest gap between chunks around and after time `after`, median gap
        before it)``, in seconds."""
        times = [t for t, _ in self.chunks]
        before = [b - a for a, b in zip(times, times[1:]) if b <= after]
        around = [b - a for a, b in zip(times, times[1:]) if b > after]
        return (
            max(around) if around else None,
            statistics.median(before) if before else None,
        )


def stream(url: str, out: Stream, max_tokens: int) -> None:
    """Stream one greedy completion of ``out.prompt`` into ``out``."""
    body = {
        "model": MODEL_NAME,
        "prompt": out.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            out.replica = r.headers.get("x-iterserve-replica", "")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    out.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"]
                    continue
                if event.get("usage"):
                    out.usage = event["usage"]
                for c in event["choices"]:
                    if c.get("text"):
                        out.chunks.append((time.monotonic(), c["text"]))
                    out.finish_reason = c.get("finish_reason") or out.finish_reason
    except httpx.HTTPError as e:
        out.failure = f"{type(e).__name__}: {e}"


def references(url: str, texts: list[str], max_tokens: int) -> list[dict]:
    """Each prompt's greedy completion, not streamed, with no fault (text and usage)."""
    out: list[dict] = [{} for _ in texts]

    def one(i: int) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": texts[i],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        data = r.json()
        out[i] = {"text": data["choices"][0]["text"], "usage": data["usage"]}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def health(url: str) -> dict:
    try:
        return httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}


def listed(h: dict) -> set[str]:
    """The replicas a ``/health`` body lists."""
    return {r["replica"] for r in h.get("replicas", [])}


def wait_replicas(url: str, n: int, timeout_s: float) -> dict:
    """The ``/health`` body once it lists ``n`` replicas and counts as many.

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(url)
        if h.get("status") == "ok" and len(listed(h)) == n and h.get("num_replicas") == n:
            return h
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {n} replicas after {timeout_s} s: {h}")
        time.sleep(0.25)


def replica_pid(unique_id: str) -> int:
    """The process id of the Serve replica with ``unique_id`` (this process must be
    connected to the cluster)."""
    import ray

    ((name, namespace),) = [
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if unique_id in a["name"]
    ]
    actor = ray.get_actor(name, namespace=namespace)
    return ray.get(actor.is_allocated.remote(), timeout=30)[0]


@dataclass
class FaultRun:
    """The outcome of one fault under live streams."""

    fault: str
    victim: str
    streams: list[Stream]
    references: list[dict]
    fault_at: float
    """``time.monotonic()`` of the signal."""
    out_of_health_s: float | None = None
    """Seconds from the signal until ``/health`` no longer listed the victim."""
    health_exact: bool = False
    """``/health`` then listed exactly as many replicas as its ``num_replicas``."""
    victim_done_s: float | None = None
    """Seconds from the signal until the victim's last stream ended."""

    def rows(self) -> list[dict]:
        out = []
        for s, ref in zip(self.streams, self.references):
            longest, median = s.pause(self.fault_at)
            out.append(
                {
                    "migrated": s.replica == self.victim,
                    "completed": s.completed,
                    "text_equal": s.text == ref["text"],
                    "usage_equal": s.usage == ref["usage"],
                    "tokens": len(s.chunks),
                    "pause_s": longest,
                    "median_gap_s": median,
                    "error": s.error,
                    "failure": s.failure,
                }
            )
        return out


def fault_run(
    url: str,
    fault: str,
    texts: list[str],
    refs: list[dict],
    max_tokens: int,
    after_tokens: int,
    send: Callable[[int], None],
    timeout_s: float = 300,
    pid_of: Callable[[str], int] = replica_pid,
) -> FaultRun:
    """Stream every prompt; once each has ``after_tokens`` chunks, ``send(pid)`` the
    fault to the process of the first stream's replica (``pid_of`` its unique id); wait
    for every stream to end, watching ``/health`` meanwhile."""
    streams = [Stream(t) for t in texts]
    threads = [threading.Thread(target=stream, args=(url, s, max_tokens)) for s in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while not all(len(s.chunks) >= after_tokens for s in streams):
        if time.monotonic() > deadline or not any(t.is_alive() for t in threads):
            raise TimeoutError(f"streams did not start: {[len(s.chunks) for s in streams]}")
        time.sleep(0.05)
    victim = streams[0].replica
    pid = pid_of(victim)
    send(pid)
    run = FaultRun(fault, victim, streams, refs, time.monotonic())
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if run.out_of_health_s is None:
            h = health(url)
            if h and victim not in listed(h):
                run.out_of_health_s = now - run.fault_at
                run.health_exact = len(listed(h)) == h.get("num_replicas")
        if run.victim_done_s is None and not any(
            t.is_alive() for t, s in zip(threads, streams) if s.replica == victim
        ):
            run.victim_done_s = now - run.fault_at
        if now > deadline:
            raise TimeoutError("streams did not end")
        time.sleep(0.1)
    if run.victim_done_s is None:
        run.victim_done_s = time.monotonic() - run.fault_at
    while run.out_of_health_s is None and time.monotonic() < deadline:
        h = health(url)
        if h and victim not in listed(h):
            run.out_of_health_s = time.monotonic() - run.fault_at
            run.health_exact = len(listed(h)) == h.get("num_replicas")
        time.sleep(0.1)
    return run


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def sigstop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


@contextmanager
def running_app(config) -> Iterator[str]:
    """``config`` (a :class:`deploy.config.ServiceConfig`) on an embedded 2-CPU Ray
    cluster, deployed as ``iterserve serve`` deploys it; yields its base URL once both
    replicas are listed, and stops Serve and Ray after."""
    import ray
    from ray import serve

    from deploy.server import deploy, embedded_serve_env, spare_port

    saved = dict(os.environ)
    os.environ.update(embedded_serve_env(config))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    os.environ.clear()
    os.environ.update(saved)
    try:
        url = deploy(config, proxy_port=spare_port(config.host))
        wait_replicas(url, config.num_replicas, timeout_s=120)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def service_config(args: argparse.Namespace, port: int):
    from deploy.config import ServiceConfig

    return ServiceConfig(
        num_replicas=2,
        replica_num_cpus=1,
        port=port,
        health_check_period_s=args.health_check_period_s,
        health_check_timeout_s=args.health_check_timeout_s,
        engine={"max_num_seqs": max(8, args.streams), "num_kv_blocks": 512},
    )


def summary(run: FaultRun) -> dict:
    rows = run.rows()
    moved = [r for r in rows if r["migrated"]]
    pauses = [r["pause_s"] for r in moved if r["pause_s"] is not None]
    gaps = [r["median_gap_s"] for r in rows if r["median_gap_s"] is not None]
    return {
        "fault": run.fault,
        "streams": len(rows),
        "migrated": len(moved),
        "completed": sum(r["completed"] for r in rows),
        "text_equal": sum(r["text_equal"] for r in rows),
        "usage_equal": sum(r["usage_equal"] for r in rows),
        "pause_s_max": max(pauses) if pauses else None,
        "pause_s_median": statistics.median(pauses) if pauses else None,
        "median_gap_s": statistics.median(gaps) if gaps else None,
        "out_of_health_s": run.out_of_health_s,
        "health_exact": run.health_exact,
        "victim_streams_done_s": run.victim_done_s,
    }


def table(summaries: list[dict], runs: list[FaultRun]) -> str:
    lines = [
        rp.table(
            [
                "fault",
                "streams",
                "on victim",
                "completed",
                "text = reference",
                "usage = reference",
                "pause max s",
                "pause median s",
                "median gap s",
                "out of /health s",
                "victim's streams done s",
            ],
            [
                [
                    s["fault"],
                    str(s["streams"]),
                    str(s["migrated"]),
                    str(s["completed"]),
                    str(s["text_equal"]),
                    str(s["usage_equal"]),
                    rp.fmt(s["pause_s_max"]),
                    rp.fmt(s["pause_s_median"]),
                    rp.fmt(s["median_gap_s"], ".3f"),
                    rp.fmt(s["out_of_health_s"], ".1f"),
                    rp.fmt(s["victim_streams_done_s"], ".1f"),
                ]
                for s in summaries
            ],
        )
    ]
    for run in runs:
        lines += ["", f"{run.fault}: per stream", ""]
        lines.append(
            rp.table(
                ["stream", "on victim", "completed", "text =", "tokens", "pause s", "median gap s"],
                [
                    [
                        str(i),
                        "yes" if r["migrated"] else "",
                        "yes" if r["completed"] else "NO",
                        "yes" if r["text_equal"] else "NO",
                        str(r["tokens"]),
                        rp.fmt(r["pause_s"]),
                        rp.fmt(r["median_gap_s"], ".3f"),
                    ]
                    for i, r in enumerate(run.rows())
                ],
            )
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser("bench.failover", __doc__)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-after", type=int, default=24, help="tokens every stream has first")
    p.add_argument("--health-check-period-s", type=float, default=1.0)
    p.add_argument("--health-check-timeout-s", type=float, default=3.0)
    cli.add_out(p, OUT, "stem of the .json and .md", type=Path)
    return p.parse_args(argv)


def expected_s(args: argparse.Namespace) -> float:
    """Start-up, the references, two fault runs and a replica's replacement."""
    return 60 + 3 * (20 + args.streams * args.max_tokens * 0.01) + 60


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cli.expected("failover", expected_s(args))
    t0 = time.monotonic()
    texts = prompts(args.streams)
    with running_app(service_config(args, free_port())) as url:
        refs = references(url, texts, args.max_tokens)
        kill = fault_run(url, "SIGKILL", texts, refs, args.max_tokens, args.kill_after, sigkill)
        wait_replicas(url, 2, timeout_s=240)
        stop = fault_run(url, "SIGSTOP", texts, refs, args.max_tokens, args.kill_after, sigstop)
    runs = [kill, stop]
    summaries = [summary(r) for r in runs]
    report = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summaries": summaries,
        "streams": {r.fault: r.rows() for r in runs},
        "wall_s": time.monotonic() - t0,
    }
    rp.write_report(args.out.with_suffix(".json"), report, table(summaries, runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
