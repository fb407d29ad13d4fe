"""How often the TPOT guard's discrete rules act, in real time and in the simulator.

``iterserve simulate --ablate`` found that shed, sit out and deadline earn nothing on the
conversation and code traces from 0.5x to 2x capacity, and last gap at most 0.5 points
(``docs/scheduling.md``): candidates for removal, if real time agrees. A rule that never
changes a plan earns nothing. This replays a window of each trace (70% interactive / 30%
batch; interactive TTFT 2 s and TPOT 0.25 s, the serving benchmark's SLOs, where the guard
binds hardest on this CPU) open loop through the in-process ``AsyncLLMEngine`` with the
server's engine settings and admission off, at 0.5x, 1x and 2x the capacity that the
simulator finds with the shipped cost model, and counts the plans each rule of
:data:`policies.slo_guard.ACTS` changed (``TpotGuard.acted``), beside the simulator's
counts for the same requests. Run from the repository root::

    .venv/bin/python bench/guard_rules_acts.py       # about 17 minutes

Writes ``bench/results/ablation/guard_acts.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import report as rp
import sim_validate as sv
from inprocess import run_open, start_engine, stop_engine
from workload import REPO, TRACE, Lengths, Window

from deploy.config import SERVER_ENGINE_DEFAULTS, ServiceConfig
from deploy.sim.fleet import Fleet
from engine.sim.cost import LinearCost
from policies import make_classes
from policies.slo_guard import ACTS

OUT = REPO / "bench" / "results" / "ablation" / "guard_acts.json"
COST = REPO / "deploy" / "sim" / "cpu_smollm2_135m.json"
SLOS = {"interactive": {"ttft_slo_s": 2.0, "tpot_slo_s": 0.25}}
ENGINE = dict(SERVER_ENGINE_DEFAULTS, traffic_classes=SLOS)
TRACES = {  # name: (file, first row, length divisor), as the ablation scales them
    "conversation": (TRACE, 3000, 8.0),
    "code": (TRACE.with_name("azure_llm_2023_code.csv"), 3000, 16.0),
}


def window(trace: str, rate: float, duration: float, tag: str) -> list:
    """The trace window's requests at ``rate`` req/s over ``duration`` s, lengths scaled."""
    path, start, div = TRACES[trace]
    lengths = Lengths(prompt_divisor=div, output_divisor=div, max_output=128)
    w = Window(path, start, round(rate * duration) + 2, lengths, sv.MIX, seed=7)
    return w.at_rate(rate, duration, tag)[0]


def simulate(reqs: list, cost: LinearCost) -> tuple[float, dict[str, int]]:
    """(interactive attainment, plans each rule changed) in the simulator."""
    service = ServiceConfig(num_replicas=1, admission=False, engine=ENGINE)
    fleet = Fleet(service, cost)
    run = fleet.run(sv.sim_requests(reqs))
    cls = make_classes(SLOS)
    met = [
        o.status == "ok"
        and o.ttft_s <= cls["interactive"].ttft_slo_s
        and o.tpot_s <= cls["interactive"].tpot_slo_s
        for o in run.outcomes
        if o.request.traffic_class == "interactive"
    ]
    acted = fleet.replicas[0].engine.scheduler.guard.acted
    return sum(met) / len(met), {r: acted[r] for r in ACTS}


def capacity(trace: str, duration: float, cost: LinearCost) -> float:
    """Highest rate (x1.25 steps from 0.4 req/s) at which the simulator meets 90% of the
    interactive requests."""
    rate, best = 0.4, 0.4
    while rate < 50 and simulate(window(trace, rate, duration, "cap"), cost)[0] >= 0.9:
        best, rate = rate, rate * 1.25
    return best


async def real(reqs: list, cutoff_s: float) -> tuple[float, dict[str, int], int]:
    """(interactive attainment, plans each rule changed, steps) in real time."""
    target, _ = await start_engine(ENGINE)
    guard, steps = target.engine.scheduler.guard, []
    before = dict(guard.acted)
    target.engine.on_step = lambda *a, **k: steps.append(1)
    try:
        run, _ = await run_open(target, reqs, cutoff_s=cutoff_s)
    finally:
        await stop_engine(target)
    cls = make_classes(SLOS)["interactive"]
    inter = [r for r in run.records if r["class"] == "interactive"]
    for r in inter:
        rp.judge(r, cls.ttft_slo_s, cls.tpot_slo_s)
    met = sum(r["slo_met"] for r in inter) / len(inter)
    return met, {r: guard.acted[r] - before.get(r, 0) for r in ACTS}, len(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", default="0.5,1,2", help="multiples of the simulated capacity")
    ap.add_argument("--duration", type=float, default=100.0, help="seconds of arrivals")
    ap.add_argument("--traces", default="conversation,code")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    traces = args.traces.split(",")
    print(
        f"expected duration: about {len(traces) * len(loads) * (args.duration + 70) / 60:.0f} min",
        flush=True,
    )
    cost, rows = LinearCost.load(COST), []
    for trace in traces:
        cap = capacity(trace, args.duration, cost)
        for load in loads:
            reqs = window(trace, cap * load, args.duration, f"{trace}-{load}")
            sim_met, sim_acted = simulate(reqs, cost)
            met, acted, steps = asyncio.run(real(reqs, args.duration + 60))
            rows.append(
                {
                    "trace": trace,
                    "capacity": cap,
                    "load": load,
                    "rate": cap * load,
                    "requests": len(reqs),
                    "real_steps": steps,
                    "real": {"interactive_met": met, "acted": acted},
                    "simulated": {"interactive_met": sim_met, "acted": sim_acted},
                }
            )
            print(f"{time.strftime('%H:%M:%S')} {trace} x{load} done", flush=True)
    print(
        "| trace | load (req/s) | steps | interactive met, real / sim | "
        + " | ".join(f"{r}, real / sim" for r in ACTS)
        + " |"
    )
    print("|---|---:|---:|---:|" + "---:|" * len(ACTS))
    for r in rows:
        acts = " | ".join(f"{r['real']['acted'][a]} / {r['simulated']['acted'][a]}" for a in ACTS)
        print(
            f"| {r['trace']} | x{r['load']:g} ({r['rate']:.2f}) | {r['real_steps']} | "
            f"{r['real']['interactive_met']:.1%} / {r['simulated']['interactive_met']:.1%} | "
            f"{acts} |"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "slos": SLOS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
