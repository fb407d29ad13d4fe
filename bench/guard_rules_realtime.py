"""The TPOT guard's soft rules in real time: all on against all off, A/B/A/B, one run.

``iterserve simulate --ablate`` measures each guard rule alone in virtual time
(``docs/scheduling.md``). Before a rule goes, the issue asks for a real-time check: this
replays one window of the conversation trace (lengths / 8, 70% interactive / 30% batch)
open loop through the in-process ``AsyncLLMEngine`` with the server's engine settings,
admission off, alternating the guard with every rule on and with the soft rules
(:data:`SOFT`) off, each on a fresh engine. The simulator runs the same requests first,
for comparison. Run from the repository root::

    .venv/bin/python bench/guard_rules_realtime.py       # about 12 minutes

Writes ``bench/results/ablation/realtime_soft_rules.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import sim_validate as sv
from inprocess import run_open, start_engine, stop_engine
from workload import REPO, TRACE, Lengths, Window

from deploy.config import SERVER_ENGINE_DEFAULTS, ServiceConfig
from deploy.sim.fleet import Fleet
from engine.sim.cost import LinearCost

SOFT = ["credit", "owed", "lend", "sit_out", "last_gap", "deadline"]
"""The rules that moved attainment by at most 0.6 points each, alone, up to 1.5x load."""
OUT = REPO / "bench" / "results" / "ablation" / "realtime_soft_rules.json"
COST = REPO / "deploy" / "sim" / "cpu_smollm2_135m.json"


def summary(latencies: dict, requests: list) -> dict:
    """Per class: requests, SLO attainment, TTFT and TPOT means (s)."""
    cls = {r.id: r.cls for r in requests}
    out = {}
    for c in ("interactive", "batch"):
        v = [x for k, x in latencies.items() if cls[k] == c]
        ttft = [x["ttft"] for x in v if x["ttft"] is not None]
        tpot = [x["tpot"] for x in v if x["tpot"] is not None]
        out[c] = {
            "n": len(v),
            "met": sum(x["met"] for x in v) / len(v),
            "ttft_mean": statistics.fmean(ttft),
            "tpot_mean": statistics.fmean(tpot),
        }
    return out


async def real(off: list[str], requests: list, cutoff_s: float) -> dict:
    target, _ = await start_engine(dict(SERVER_ENGINE_DEFAULTS, tpot_slo_guard_rules_off=off))
    try:
        run, _ = await run_open(target, requests, cutoff_s=cutoff_s)
    finally:
        await stop_engine(target)
    return summary(sv.real_latencies(run.records), requests)


def simulated(off: list[str], requests: list, cutoff_s: float) -> dict:
    service = ServiceConfig(
        num_replicas=1,
        admission=False,
        engine=dict(SERVER_ENGINE_DEFAULTS, tpot_slo_guard_rules_off=off),
    )
    run = Fleet(service, LinearCost.load(COST)).run(sv.sim_requests(requests))
    return summary(sv.sim_latencies(run, cutoff_s), requests)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window-start", type=int, default=6000)
    ap.add_argument("--rate", type=float, default=1.3, help="req/s (near capacity here)")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of arrivals")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    print(
        f"expected duration: about {args.pairs * 2 * (args.duration + 30) / 60:.0f} min", flush=True
    )
    window = Window(
        TRACE,
        args.window_start,
        round(args.rate * args.duration) + 2,
        Lengths(max_output=128),
        sv.MIX,
        seed=7,
    )
    cutoff = args.duration + 60
    rows = []
    for off in ([], SOFT):
        reqs, _ = window.at_rate(args.rate, args.duration, "sim")
        rows.append({"system": "simulated", "off": off, **simulated(off, reqs, cutoff)})
    for k in range(2 * args.pairs):
        off = SOFT if k % 2 else []
        reqs, _ = window.at_rate(args.rate, args.duration, f"r{k}")
        rows.append({"system": "real", "off": off, **asyncio.run(real(off, reqs, cutoff))})
        print(f"{time.strftime('%H:%M:%S')} real run {k} done", flush=True)
    print(
        "| system | soft rules | interactive met | batch met | interactive TTFT / TPOT mean (s) |"
    )
    print("|---|---|---:|---:|---:|")
    for r in rows:
        i = r["interactive"]
        print(
            f"| {r['system']} | {'off' if r['off'] else 'on'} | {i['met']:.1%} | "
            f"{r['batch']['met']:.1%} | {i['ttft_mean']:.3f} / {i['tpot_mean']:.4f} |"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"args": vars(args), "soft_rules": SOFT, "rows": rows}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
