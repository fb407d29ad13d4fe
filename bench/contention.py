"""How much other processes' CPU slows the engine's steps, and how much of the served cost
per token that explains.

Run from the repository root (prints its expected duration first)::

    .venv/bin/python bench/contention.py            # ~3 min
    .venv/bin/python bench/contention.py --quick    # ~1 min

1. **Offline sensitivity.** iterserve's offline engine decodes 1 and 8 streams (greedy,
   ``ignore_eos``, 16-token random prompts; ms per step as in ``bench/offline_peer.py``)
   while a burner process keeps a share of one core busy (0, 5, 10 and 20%) in 1 ms bursts
   at random gaps, as the serving stack's per-token work arrives. The repeats cycle
   through the shares, so host drift spreads over all of them. The burner's measured CPU
   is the x-axis; the slope (least squares through the origin) is the step's relative
   slowdown per core of foreign CPU.
2. **Served.** ``iterserve serve`` with its defaults on Ray Serve (``--address local``;
   by default one replica serves in its own process, with no stack to measure), the
   peers benchmark's token-cost probe (``bench/peer_servers.py``) at 1 and 8 streams,
   and every process group's CPU during each probe. The replica's own threads are split
   into the engine's (its busiest ``torch threads``) and the rest (Ray's, the event loop),
   which count as foreign.
3. **Explained.** ``offline ms x (1 + slope x foreign cores)`` against the measured ms per
   token; what is left over is cost the contention does not explain.

Output: ``bench/results/contention.json`` and the tables on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import peer_servers as ps
import report as rp
from offline_peer import Engine, ids
from offline_peer import decode_ms as offline_decode_ms

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
DUTIES = (0.0, 0.05, 0.10, 0.20)
STREAMS = (1, 8)
BURNER = """
import random, sys, time
duty, burst = float(sys.argv[1]), 0.001
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < burst:
        pass
    time.sleep(random.expovariate(duty / (burst * (1 - duty))))
"""


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads."""
    return ps.proc_stat(pid, tid)[1]


def decode_ms(eng: Engine, n: int, tokens: int, seed: int) -> float:
    """ms per decode step with ``n`` streams of 16-token prompts drawn from ``seed``."""
    rng = random.Random(seed)
    return offline_decode_ms(eng, [ids(rng, 16) for _ in range(n)], tokens)


def burned(eng: Engine, duty: float, n: int, tokens: int, seed: int) -> tuple[float, float]:
    """(ms per step, cores the burner used) with a burner at ``duty`` (none at 0)."""
    if duty == 0:
        return decode_ms(eng, n, tokens, seed), 0.0
    proc = subprocess.Popen([sys.executable, "-c", BURNER, str(duty)])
    try:
        time.sleep(0.2)
        c0, t0 = proc_cpu_s(proc.pid), time.monotonic()
        ms = decode_ms(eng, n, tokens, seed)
        cores = (proc_cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
    finally:
        proc.kill()
        proc.wait()
    return ms, cores


def slope(points: list[tuple[float, float]], base: float) -> float:
    """Least-squares slope through the origin of (cores, ms / base - 1)."""
    sxx = sum(x * x for x, _ in points)
    return sum(x * (y / base - 1) for x, y in points) / sxx if sxx else 0.0


def offline_phase(model: str, repeats: int, tokens: int) -> dict:
    eng = Engine("iterserve", model)
    decode_ms(eng, 8, 8, 0)  # warm-up
    runs: dict[str, list[tuple[float, float, float]]] = {str(n): [] for n in STREAMS}
    for rep in range(repeats):
        for duty in DUTIES:
            for n in STREAMS:
                ms, cores = burned(eng, duty, n, tokens, seed=rep)
                runs[str(n)].append((duty, cores, ms))
                print(
                    f"[contention] {n} stream(s), burner {duty:.0%}: {ms:.1f} ms/step, "
                    f"burner {cores:.3f} cores",
                    flush=True,
                )
    out = {}
    for n, rows in runs.items():
        base = statistics.median(ms for d, _, ms in rows if d == 0)
        out[n] = {
            "runs": rows,
            "ms_at_0": base,
            "slope": slope([(c, ms) for d, c, ms in rows if d > 0], base),
        }
    return out


def replica_split(
    before: dict[int, float], after: dict[int, float], wall_s: float, engine_threads: int
) -> tuple[float, float]:
    """(cores of the engine's threads, cores of the replica's other threads)."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return sum(used[:engine_threads]) / wall_s, sum(used[engine_threads:]) / wall_s


def thread_cpu(pid: int) -> dict[int, float]:
    """tid -> CPU seconds of each of the process's threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = proc_cpu_s(pid, int(tid))
        except OSError:
            pass
    return out


def replica_pid() -> int:
    """The iterserve replica's process (one replica on Ray Serve)."""
    return next(pid for pid, (group, _) in ps.cpu_seconds().items() if group == "iterserve replica")


async def probe(server: ps.Server, n: int, tokens: int, engine_threads: int) -> dict:
    pid = replica_pid()
    before, threads0, t0 = ps.cpu_seconds(), thread_cpu(pid), time.monotonic()
    cost = await ps.token_cost(server, n, tokens)
    wall = time.monotonic() - t0
    share = ps.cpu_share(before, ps.cpu_seconds(), wall)
    engine_cores, replica_other = replica_split(threads0, thread_cpu(pid), wall, engine_threads)
    share.pop("iterserve replica", None)
    share["iterserve replica, other threads"] = replica_other
    return {
        "ms_per_token": cost["ms_per_token"],
        "engine_cores": engine_cores,
        "foreign": dict(sorted(share.items(), key=lambda kv: -kv[1])),
    }


def served_phase(model: str, tokens: int) -> dict:
    spec = ps.SYSTEMS["iterserve-ray"]
    with ps.Server(spec, model, mix=False, slo=(2.0, 0.25)) as server:
        return {str(n): asyncio.run(probe(server, n, tokens, os.cpu_count() or 1)) for n in STREAMS}


def explain(offline: dict, served: dict) -> list[dict]:
    rows = []
    for n in map(str, STREAMS):
        off, srv = offline[n], served[n]
        foreign = sum(srv["foreign"].values())
        predicted = off["ms_at_0"] * (1 + off["slope"] * foreign)
        rows.append(
            {
                "streams": int(n),
                "offline_ms": off["ms_at_0"],
                "slope": off["slope"],
                "foreign_cores": foreign,
                "predicted_ms": predicted,
                "served_ms": srv["ms_per_token"],
                "overhead": srv["ms_per_token"] / off["ms_at_0"] - 1,
                "explained": predicted / off["ms_at_0"] - 1,
            }
        )
    return rows


def print_tables(rows: list[dict], served: dict) -> None:
    print(
        rp.table(
            [
                "streams",
                "offline ms",
                "slowdown per core",
                "foreign cores",
                "explained",
                "served ms",
                "served overhead",
            ],
            [
                [
                    str(r["streams"]),
                    rp.fmt(r["offline_ms"], ".1f"),
                    rp.fmt(r["slope"], ".2f"),
                    rp.fmt(r["foreign_cores"], ".3f"),
                    rp.pct(r["explained"]),
                    rp.fmt(r["served_ms"], ".1f"),
                    rp.pct(r["overhead"]),
                ]
                for r in rows
            ],
        )
    )
    groups = sorted({g for s in served.values() for g in s["foreign"]})
    print(
        rp.table(
            ["process group (cores)", *(f"{n} stream(s)" for n in served)],
            [
                [g, *(rp.fmt(s["foreign"].get(g, 0.0), ".3f") for s in served.values())]
                for g in groups
            ],
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    repeats, tokens = (1, 33) if args.quick else (3, 65)
    print(f"[contention] expected duration: about {1 if args.quick else 3} min", flush=True)
    model = ps.model_dir()
    offline = offline_phase(model, repeats, tokens)
    served = served_phase(model, 48 if args.quick else 96)
    rows = explain(offline, served)
    print_tables(rows, served)
    out = Path(args.out or RESULTS / f"contention{'_quick' if args.quick else ''}.json")
    rp.write_json(
        {"machine": ps.machine_info(), "offline": offline, "served": served, "explained": rows}, out
    )
    print(f"[contention] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
