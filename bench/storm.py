"""A storm of streamed requests on a shared host: does any stream go silent?

    python -m bench.storm            # about 4 minutes (printed first)
    python -m bench.storm --no-load  # without the CPU-heavy neighbour
    python -m bench.storm --tree ../before --out /tmp/storm_before.json  # another checkout

``iterserve serve`` with its defaults (one replica in its own process) gets ``--requests``
streamed completions, ``--concurrency`` at a time, prompts of 16 to ``--max-prompt``
tokens (real text), 8 to 64 output tokens, while ``--load`` busy-loop processes share
the host (a CPU-heavy neighbour, as on a shared machine). A share of the clients
(``--hang-up``) hang up at a random moment. A load balancer with the common 60 s idle
timeout would cut a stream that stays silent that long.

Per stream it records the status, the seconds from sending to the response headers, from
the headers to the first byte, the longest silence between bytes (SSE comments count as
bytes: they are what keeps such a stream alive) from sending to the end, the SSE
comments received, and how it ended: ``done`` (``data: [DONE]`` after its tokens),
``error_event`` (an error event, then ``data: [DONE]``), ``refused`` (429 before it
opened, with Retry-After), ``hung_up`` (the client left), ``cut_idle`` (silent for
longer than a load balancer's idle timeout: the client cuts it there, as the balancer
would), or ``cut`` (the connection ended without ``[DONE]``). It reports how many
streams were silent longer than their class's queue bound
(:func:`router.ingress.queue_bound`; none should be) and longer than 60 s, the server's
refusal and abort counters, and whether the replica was idle (no request running or
waiting, no KV block in use) within ``IDLE_WITHIN_S`` of the end: a refused or abandoned
request must leave nothing behind. ``--tree`` serves another checkout's code with the
same client, to compare (its file goes where ``--out`` says, never committed).

Writes ``bench/results/storm.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores
from bench.toolkit.prompts import prompt_maker
from bench.toolkit.servers import MODEL_NAME, Process, model_dir
from deploy.config import ServiceConfig
from policies import DEFAULT_CLASS
from router.ingress import queue_bound

OUT = RESULTS / "storm.json"
LB_IDLE_TIMEOUT_S = 60.0
"""A common load-balancer idle timeout (AWS ALB's default, nginx's proxy_read_timeout)."""
EXPECTED_S = 240
IDLE_WITHIN_S = 15.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser("bench.storm", __doc__)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=40)
    p.add_argument("--max-prompt", type=int, default=1500, help="longest prompt, tokens")
    p.add_argument("--hang-up", type=float, default=0.25, help="share of clients that leave")
    p.add_argument(
        "--load",
        type=int,
        default=1,
        help="busy-loop processes beside the server (0: none; default 1)",
    )
    p.add_argument("--no-load", dest="load", action="store_const", const=0)
    p.add_argument("--port", type=int, default=8127)
    cli.add_seed(p)
    p.add_argument(
        "--service",
        type=json.loads,
        default={},
        help="ServiceConfig overrides as JSON, e.g. '{\"max_queue_time_s\": 10}'",
    )
    p.add_argument(
        "--tree",
        type=Path,
        default=REPO,
        help="serve this checkout's code (e.g. a tree without the queue bound, to compare)",
    )
    cli.add_out(p, OUT, "the result file", type=Path)
    return p.parse_args(argv)


class _Serve(Process):
    """``iterserve serve`` of ``config`` with ``tree``'s code (first on ``PYTHONPATH``), ready
    once its log says so."""

    def __init__(self, config: dict[str, Any], tree: Path = REPO) -> None:
        pythonpath = f"{tree}:{os.environ.get('PYTHONPATH', '')}"
        url = f"http://127.0.0.1:{config['port']}"
        super().__init__("iterserve", [], url, env={"PYTHONPATH": pythonpath}, cwd=tree)
        path = self.dir / "service.yaml"
        path.write_text(yaml.safe_dump(config))
        self.command = [str(Path(sys.executable).parent / "iterserve"), "serve", "--config"]
        self.command.append(str(path))

    def ready(self) -> bool:
        return "is ready" in self.log.read_text()

    def log_lines(self, pattern: str) -> list[str]:
        return [ln for ln in self.log.read_text().splitlines() if re.search(pattern, ln)]


def _busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep a core busy until killed."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict, leave_after_s: float | None
) -> dict[str, Any]:
    """One streamed request; its record (see the module docstring)."""
    rec: dict[str, Any] = {
        "status": None,
        "headers_s": None,
        "first_byte_s": None,
        "longest_silence_s": 0.0,
        "comments": 0,
        "data_events": 0,
        "end": "cut",
        "error": None,
        "leave_after_s": leave_after_s,
    }
    sent = last = time.monotonic()

    def byte_arrived() -> None:
        nonlocal last
        now = time.monotonic()
        rec["longest_silence_s"] = max(rec["longest_silence_s"], now - last)
        last = now

    async def read() -> None:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            byte_arrived()
            rec["status"] = resp.status
            rec["headers_s"] = time.monotonic() - sent
            if resp.status != 200:
                text = await resp.text()
                rec["end"] = "refused" if resp.status == 429 else f"http_{resp.status}"
                rec["retry_after"] = resp.headers.get("Retry-After")
                rec["error"] = text[:300]
                return
            buf = b""
            async for part in resp.content.iter_any():
                byte_arrived()
                if rec["first_byte_s"] is None:
                    rec["first_byte_s"] = time.monotonic() - sent - rec["headers_s"]
                buf += part
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.decode()
                    if line.startswith(":"):
                        rec["comments"] += 1
                    elif line == "data: [DONE]":
                        rec["end"] = "error_event" if rec["error"] else "done"
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if obj.get("error"):
                            rec["error"] = obj["error"].get("code") or obj["error"]["message"]
                        else:
                            rec["data_events"] += 1

    try:
        if leave_after_s is None:
            await read()
        else:
            await asyncio.wait_for(read(), leave_after_s)
    except aiohttp.ServerTimeoutError:  # (a TimeoutError too) silent past the idle timeout
        rec["end"] = "cut_idle"
        byte_arrived()
    except TimeoutError:
        rec["end"] = "hung_up"
        byte_arrived()  # the silence up to the hang-up counts too
    except aiohttp.ClientError as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        byte_arrived()
    rec["total_s"] = time.monotonic() - sent
    return rec


async def storm(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], float]:
    rng = random.Random(args.seed)
    prompts = prompt_maker(model_dir(), args.seed)
    bodies = []
    for i in range(args.requests):
        text, n = prompts.make(i, rng.randint(16, args.max_prompt))
        body = {
            "model": MODEL_NAME,
            "prompt": text,
            "max_tokens": rng.randint(8, 64),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        leave = rng.uniform(0.5, 20.0) if rng.random() < args.hang_up else None
        bodies.append((body, n, leave))
    gate = asyncio.Semaphore(args.concurrency)
    # As a load balancer in front would: a connection silent this long is cut.
    timeout = aiohttp.ClientTimeout(total=None, sock_read=LB_IDLE_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def one(i: int) -> dict[str, Any]:
            body, n, leave = bodies[i]
            async with gate:
                rec = await _one(session, url, body, leave)
            return {"i": i, "prompt_tokens": n, "max_tokens": body["max_tokens"], **rec}

        t0 = time.monotonic()
        records = await asyncio.gather(*(one(i) for i in range(args.requests)))
    return list(records), time.monotonic() - t0


def _idle_after(url: str, within_s: float) -> float | None:
    """Seconds until the replica runs and holds nothing; None if not within ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        h = httpx.get(f"{url}/health", timeout=10).json()
        reps = h.get("replicas") or []
        if reps and all(r["running"] == r["waiting"] == 0 and r["kv_usage"] == 0 for r in reps):
            return time.monotonic() - start
        time.sleep(0.2)
    return None


def _counters(url: str) -> dict[str, float]:
    """The server's refusal and abort counters, summed over classes."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'iterserve:admission_rejections_total\{.*reason="(\w+)".*\} (\S+)', line)
        if m:
            out[f"rejected_{m[1]}"] = out.get(f"rejected_{m[1]}", 0.0) + float(m[2])
        m = re.match(r"iterserve:request_aborted_total\{.*\} (\S+)", line)
        if m:
            out["aborted"] = out.get("aborted", 0.0) + float(m[1])
    return {k: v for k, v in out.items() if v}


def markdown(result: dict[str, Any]) -> str:
    """A result file's summary as a markdown table."""
    s = result["summary"]
    rows = [
        ["streams", str(s["requests"])],
        [f"queue bound of the class (s): {s['class_bound_source']}", f"{s['class_bound_s']:g}"],
        ["keepalive comment after (s)", f"{s['stream_keepalive_s']:g}"],
        ["**streams silent longer than the bound**", f"**{s['silent_over_class_bound']}**"],
        [f"streams silent longer than {LB_IDLE_TIMEOUT_S:g} s", str(s["silent_over_60s"])],
        [
            "longest silence of a stream (s): max / median",
            f"{s['longest_silence_s']:.1f} / {s['longest_silence_p50_s']:.1f}",
        ],
        ["streams that got a keepalive comment", str(s["streams_with_comments"])],
        *[[f"ended: {k}", str(v)] for k, v in sorted(s["ends"].items())],
        *[[f"server counted: {k}", f"{v:g}"] for k, v in sorted(s["server_counters"].items())],
        ["ERROR lines in the server's log", str(s["server_errors_logged"])],
        ["replica idle after the storm within (s)", rp.fmt(s["idle_after_s"], ".1f", "never")],
        [
            "cores busy outside the client (server, load, others)",
            rp.fmt(s["other_processes_cores"], ".2f"),
        ],
    ]
    return rp.table(["storm", "value"], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A stop from outside (timeout's SIGTERM) still runs the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cli.expected("storm", EXPECTED_S)
    config = ServiceConfig(port=args.port, **args.service)
    bound = queue_bound(config.traffic_classes()[DEFAULT_CLASS], config.max_queue_time_s)
    assert bound is not None, "the storm's class must be rejectable"
    bound_s, source = bound
    keepalive_s = config.stream_keepalive_s
    loads = _busy_loops(args.load)
    try:
        # Only the fields set: another checkout's config may lack the newer ones.
        fields = config.model_dump(mode="json", exclude_unset=True)
        with _Serve(fields, args.tree) as server:
            cpu0 = cpu_snapshot()
            records, wall_s = asyncio.run(storm(args, server.url))
            # Every other process: the server, the busy loops and whatever else ran.
            others = foreign_cores(cpu0, cpu_snapshot(), wall_s)
            idle_s = _idle_after(server.url, IDLE_WITHIN_S)
            counters = _counters(server.url)
            errors_logged = len(server.log_lines(r"^ERROR|Traceback"))
    finally:
        for p in loads:
            p.kill()
            p.wait()
    over_bound = [r for r in records if r["longest_silence_s"] > bound_s]
    over_lb = [r for r in records if r["longest_silence_s"] > LB_IDLE_TIMEOUT_S]
    ends: dict[str, int] = {}
    for r in records:
        ends[r["end"]] = ends.get(r["end"], 0) + 1
    silences = [r["longest_silence_s"] for r in records]
    summary = {
        "requests": len(records),
        "wall_s": wall_s,
        "class_bound_s": bound_s,
        "class_bound_source": source,
        "stream_keepalive_s": keepalive_s,
        "silent_over_class_bound": len(over_bound),
        "silent_over_60s": len(over_lb),
        "longest_silence_s": max(silences),
        "longest_silence_p50_s": rp.percentile(silences, 50),
        "ends": ends,
        "streams_with_comments": sum(r["comments"] > 0 for r in records),
        "refused_without_retry_after": sum(
            r["end"] == "refused" and not r.get("retry_after") for r in records
        ),
        "server_counters": counters,
        "server_errors_logged": errors_logged,
        "idle_after_s": idle_s,
        "other_processes_cores": others,
    }
    report = {
        "wall_s": wall_s,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "tree")}
        | {"tree": "this checkout" if args.tree == REPO else str(args.tree)}
        | {"load_processes": args.load},
        "summary": summary,
        "records": [rp.compact_record(r) for r in records],
    }
    rp.write_report(args.out, report, markdown(report), md_file=False)
    return 0 if not over_bound else 1


if __name__ == "__main__":
    sys.exit(main())
