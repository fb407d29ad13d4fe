"""Validate ``iterserve simulate`` against the real engine on this machine, in one run.

Run from the repository root::

    python -m bench.sim_validate            # prints its expected duration first
    python -m bench.sim_validate --quick    # a shorter run

1. Calibrate: ``engine.sim.calibrate`` runs the real engine over its sweep and fits the
   step-time model, in this run and again right before each rate's replay, so that the
   host's drift between fit and replay stays small (the rates run in increasing order,
   so one fit for all of them confounds load with the time since the fit).
2. Real: a window of the conversation trace (lengths / 8, 70% interactive / 30% batch,
   fixed per row), replayed open loop at four rates (light, near, at and past capacity:
   by default :data:`CAPACITY_MULTIPLES` of the capacity the simulator finds with this
   run's fit)
   through the in-process ``AsyncLLMEngine`` with the server's engine settings (priority
   policy, TPOT guard), no admission; new prompt token ids at each rate. Requests still
   running ``--drain`` s after the last arrival are cut off (misses).
3. Simulated: the same requests (arrival times, lengths, classes) through
   :class:`deploy.sim.fleet.Fleet` with one replica, the fitted model and admission off.

Report: per rate, mean and p99 TTFT and TPOT, real against simulated, and their errors;
SLO attainment; goodput (highest rate with >= 90% of requests within both SLOs); the
targets (:func:`targets`); as a diagnosis, each rate simulated again
with the fit rescaled to the host's speed during that replay (:func:`step_errors`); and
the real engine against itself: the rate at :data:`REPEAT_INDEX` replayed once more.
Output:
``bench/results/sim_validation.md`` and ``.json`` (``_quick`` with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import sys
import time
from typing import Any

from bench.toolkit import report as rp
from bench.toolkit.inprocess import run_open, start_engine, stop_engine
from bench.toolkit.workload import ATTRIBUTION, REPO, TRACE, Lengths, Window
from deploy.config import SERVER_ENGINE_DEFAULTS, ServiceConfig
from deploy.sim.fleet import Fleet
from deploy.sim.trace import SimRequest
from engine.config import EngineConfig
from engine.sim import StepShape
from engine.sim.calibrate import calibrate, periods
from policies import DEFAULT_CLASSES

# The report: the targets against the validation's bars, and the markdown.
YES = {True: "yes", False: "no"}
BARS = {"mean": 0.05, "p99": 0.10}
"""The bars: mean TTFT and TPOT within 5%, p99 within 10%."""


def goodput(rows: list[dict], key: str) -> float | None:
    """The highest rate (req/s) whose ``key`` attainment is at least 90% (None: none)."""
    return max((r["rate"] for r in rows if r[key] >= rp.GOODPUT_ATTAINMENT), default=None)


def within_bars(row: dict) -> dict[str, bool]:
    """Per statistic in :data:`BARS`: whether both TTFT's and TPOT's errors are within it."""
    return {
        stat: all(abs(row[f"{m}_{stat}"]["error"]) <= BARS[stat] for m in ("ttft", "tpot"))
        for stat in BARS
    }


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """Each rate against the bars (mean TTFT and TPOT errors within ``BARS["mean"]``, p99
    errors within ``BARS["p99"]``), and whether the real mean TTFT and TPOT lie within the
    means the simulation gives at costs x0.95 and x1.05: whether a step-time error of 5%
    or less accounts for the disagreement."""
    out = []
    for r in rows:
        lo, hi = r["sensitivity"]["0.95"], r["sensitivity"]["1.05"]
        out.append(
            {
                "rate": r["rate"],
                "load": r["load"],
                **within_bars(r),
                "band": all(
                    lo[f"{m}_mean"] <= r[f"{m}_mean"]["real"] <= hi[f"{m}_mean"]
                    for m in ("ttft", "tpot")
                ),
            }
        )
    return out


def goodput_within_one_step(rows: list[dict]) -> bool:
    """Real and simulated goodput are the same rate or neighbours in the run's rates."""
    rates = [r["rate"] for r in rows]
    g = [goodput(rows, k) for k in ("attainment_real", "attainment_sim")]
    idx = [rates.index(x) if x is not None else -1 for x in g]
    return abs(idx[0] - idx[1]) <= 1


def targets_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "## Targets",
        "",
        f"| load (x capacity) | rate (req/s) | TTFT and TPOT means within "
        f"{BARS['mean']:.0%} | p99s within {BARS['p99']:.0%} | real means within the "
        "simulation's at costs x0.95-x1.05 |",
        "|---:|---:|---|---|---|",
    ]
    for t in targets(rows):
        load = f"{t['load']:.2f}" if t["load"] is not None else "-"
        lines.append(
            f"| {load} | {t['rate']:g} | {YES[t['mean']]} | {YES[t['p99']]} | {YES[t['band']]} |"
        )
    return lines + ["", f"Goodput within one load step: {YES[goodput_within_one_step(rows)]}.", ""]


def fits_markdown(rows: list[dict]) -> list[str]:
    names = list(rows[0]["fit"]["reference_ms"])
    lines = [
        "| rate (req/s) | steps | held-out MAPE | "
        + " | ".join(f"{n}, predicted ms" for n in names)
        + " |",
        "|---:|---:|---:|" + "---:|" * len(names),
    ]
    for r in rows:
        f = r["fit"]
        lines.append(
            f"| {r['rate']:g} | {f['steps']} | {f['held_out_mape']:.1%} | "
            + " | ".join(f"{f['reference_ms'][n]:.1f}" for n in names)
            + " |"
        )
    return lines + [""]


def rescaled_markdown(rows: list[dict]) -> list[str]:
    """The simulation with the fit rescaled to the host's speed during each replay."""
    lines = [
        "## The simulation rescaled to the replay's own steps",
        "",
        "A diagnosis, not a prediction: every cost coefficient divided by the replay's "
        "total predicted / measured step seconds (one number taken from the real run), "
        "so that what remains is the simulator's scheduling, not the host's drift "
        "between the fit and the replay.",
        "",
        "| rate (req/s) | rescale | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | "
        "attainment, real / simulated | means, p99s within the bars |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        x = r["rescaled"]
        lines.append(
            f"| {r['rate']:g} | "
            f"x{1 / r['step_error']['all']['total_predicted_over_real']:.3f} | "
            + " | ".join(
                f"{x[m]['error']:+.1%}" for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99")
            )
            + f" | {x['attainment_real']:.1%} / {x['attainment_sim']:.1%} | "
            + ", ".join(YES[v] for v in within_bars(x).values())
            + " |"
        )
    return lines


def repeat_markdown(again: dict | None) -> list[str]:
    """The real engine against itself: one rate's requests replayed a second time."""
    if again is None:
        return []
    lines = [
        "## The real engine against itself",
        "",
        f"The {again['rate']:g} req/s requests again, through a fresh engine after the "
        "other rates. A bar can be judged at this load only where the two real runs "
        "agree within it.",
        "",
        "| metric | first run | second run | difference |",
        "|---|---:|---:|---:|",
    ]
    for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"):
        v = again[m]
        lines.append(
            f"| {m.replace('_', ' ')} (s) | {v['real']:.3f} | {v['sim']:.3f} | {v['error']:+.1%} |"
        )
    bars = within_bars(again)
    return lines + [
        f"| attainment | {again['attainment_real']:.1%} | {again['attainment_sim']:.1%} | |",
        "",
        f"The two real runs agree within the bars: means {YES[bars['mean']]}, "
        f"p99s {YES[bars['p99']]}.",
    ]


def markdown(rep: dict[str, Any]) -> str:
    lines = [
        "# The simulator against the real engine (one run)",
        "",
        f"Trace: {rep['trace']}. One replica, the server's engine settings, admission "
        "off. A fresh calibration before each rate (the first also set the rates):",
        "",
        *fits_markdown(rep["rows"]),
        *targets_markdown(rep["rows"]),
        "## Real against simulated",
        "",
        "| rate (req/s) | metric | real | simulated | error |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rep["rows"]:
        for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"):
            v = r[m]
            lines.append(
                f"| {r['rate']:g} | {m.replace('_', ' ')} (s) | {v['real']:.3f} | "
                f"{v['sim']:.3f} | {v['error']:+.1%} |"
            )
        lines.append(
            f"| {r['rate']:g} | attainment | {r['attainment_real']:.1%} | "
            f"{r['attainment_sim']:.1%} | |"
        )
    g_real, g_sim = goodput(rep["rows"], "attainment_real"), goodput(rep["rows"], "attainment_sim")
    lines += [
        "",
        f"Goodput (>= 90% attainment): real {g_real} req/s, simulated {g_sim} req/s.",
        f"Requests compared per rate: {[r['compared'] for r in rep['rows']]}; cut off "
        f"(real): {[r['cut_off'] for r in rep['rows']]}; preemptions real / simulated: "
        f"{[(r['preemptions_real'], r['preemptions_sim']) for r in rep['rows']]}.",
        "Cost model on the replay's own steps, median predicted / real period (all steps; "
        "decode-only): "
        + ", ".join(
            f"{r['rate']:g} req/s: {r['step_error']['all']['median_predicted_over_real']:.2f}"
            f"; {r['step_error']['decode_only']['median_predicted_over_real']:.2f}"
            for r in rep["rows"]
        )
        + ".",
        "",
        "The simulation with every cost coefficient scaled (mean TTFT / mean TPOT, s; attainment):",
        "",
    ]
    for r in rep["rows"]:
        lines.append(
            f"- {r['rate']:g} req/s: "
            + "; ".join(
                f"x{f} {v['ttft_mean']:.3f} / {v['tpot_mean']:.4f}, {v['attainment']:.1%}"
                for f, v in r["sensitivity"].items()
            )
        )
    return (
        "\n".join(
            lines + ["", *rescaled_markdown(rep["rows"]), "", *repeat_markdown(rep.get("repeat"))]
        )
        + "\n"
    )


# The run: calibration, real and simulated replays, the command line.
RESULTS = REPO / "bench" / "results"
MIX = {"interactive": 0.7, "batch": 0.3}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--window-start", type=int, default=3000, help="first trace row")
    ap.add_argument(
        "--rates",
        default=None,
        help="req/s, comma-separated (default: light, near and past capacity, "
        "1/3, 1 and 1.5 times the simulated capacity on this host)",
    )
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    ap.add_argument("--drain", type=float, default=60.0)
    ap.add_argument("--steps-per-level", type=int, default=None)
    args = ap.parse_args(argv)
    rates = args.rates or ("0.4,0.8" if args.quick else None)
    args.rates = [float(x) for x in rates.split(",")] if rates else None
    args.loads = None  # multiples of capacity, when the rates come from it
    args.duration = args.duration or (60.0 if args.quick else 150.0)
    args.steps_per_level = args.steps_per_level or (15 if args.quick else 40)
    return args


def estimate_s(args: argparse.Namespace) -> float:
    return (
        20
        + len(args.rates or CAPACITY_MULTIPLES) * (args.duration + 40 + args.steps_per_level * 2.2)
        + args.duration
        + 30
    )


CAPACITY_MULTIPLES = (1 / 3, 0.85, 1.0, 1.5)
"""Default loads, in multiples of the simulated capacity: fixed rates chosen on one host
were all below capacity on a faster one.
0.85 is where Vidur judges its fidelity under dynamic load ("request load at 85% of the
maximum serving capacity", Agrawal et al., MLSys 2024, and its README): at capacity
itself a few percent of step time is most of the queueing (:func:`sensitivity`)."""
REPEAT_INDEX = 1
"""The rate replayed a second time (0.85 load by default): the same requests through a
fresh engine after the other rates, to show how far the real engine repeats itself, the
spread against which the bars can be read."""


def window_requests(args: argparse.Namespace, rate: float, seed: int, tag: str) -> list:
    """The window's requests at ``rate`` req/s over ``args.duration`` s (``seed``: which
    prompt token ids, so that no rate hits the prefix cache of another)."""
    need = round(rate * args.duration) + 2
    window = Window(TRACE, args.window_start, need, Lengths(max_output=128), MIX, seed=seed)
    return window.at_rate(rate, args.duration, tag)[0]


def simulated_capacity(args: argparse.Namespace, cost) -> float:
    """The highest rate (x1.25 steps from 0.4 req/s; 0.4 if none) at which the simulator,
    with this run's fit, meets 90% attainment on the window: where to put the real loads."""
    service = ServiceConfig(num_replicas=1, admission=False, engine=dict(SERVER_ENGINE_DEFAULTS))
    rate, best = 0.4, 0.4
    while rate < 50:
        reqs = window_requests(args, rate, 0, "capacity")
        cutoff = args.duration + args.drain
        met = sim_latencies(Fleet(service, cost).run(sim_requests(reqs)), cutoff)
        if sum(v["met"] for v in met.values()) / len(met) < rp.GOODPUT_ATTAINMENT:
            break
        best, rate = rate, rate * 1.25
    return best


def sim_requests(reqs) -> list[SimRequest]:
    return [SimRequest(r.id, r.arrival_s, r.prompt_tokens, r.max_tokens, r.cls) for r in reqs]


def real_latencies(records: list[dict]) -> dict[str, dict[str, Any]]:
    out = {}
    for r in records:
        cls = DEFAULT_CLASSES[r["class"]]
        rp.judge(r, cls.ttft_slo_s, cls.tpot_slo_s)
        out[r["id"]] = {
            "ttft": r["ttft_s"] if r["ok"] else None,
            "tpot": r["tpot_s"] if r["ok"] and r["output_tokens"] > 1 else None,
            "met": r["slo_met"],
        }
    return out


def sim_latencies(run, cutoff_s: float) -> dict[str, dict[str, Any]]:
    out = {}
    for o in run.outcomes:
        cls = DEFAULT_CLASSES[o.request.traffic_class]
        done = o.status == "ok" and o.finish_s <= cutoff_s
        out[o.request.id] = {
            "ttft": o.ttft_s if done else None,
            "tpot": o.tpot_s if done and o.request.output_tokens > 1 else None,
            "met": done and o.ttft_s <= cls.ttft_slo_s and o.tpot_s <= cls.tpot_slo_s,
        }
    return out


def compare(real: dict, sim: dict) -> dict[str, Any]:
    """Mean and p99 of TTFT and TPOT over the requests both finished, and attainment."""
    both = [k for k in real if real[k]["ttft"] is not None and sim[k]["ttft"] is not None]
    row: dict[str, Any] = {"requests": len(real), "compared": len(both)}
    for m in ("ttft", "tpot"):
        xs = [k for k in both if real[k][m] is not None and sim[k][m] is not None]
        for stat, f in (("mean", statistics.fmean), ("p99", lambda v: rp.percentile(v, 99))):
            a, b = f([real[k][m] for k in xs]), f([sim[k][m] for k in xs])
            row[f"{m}_{stat}"] = {"real": a, "sim": b, "error": (b - a) / a if a else None}
    for name, d in (("real", real), ("sim", sim)):
        row[f"attainment_{name}"] = sum(v["met"] for v in d.values()) / len(d)
    return row


REFERENCE_SHAPES = {
    "1 decode": StepShape(0, 1, 200, 0.0, 0),
    "8 decodes": StepShape(0, 8, 1600, 0.0, 0),
    "256-token prefill": StepShape(256, 0, 0, 256 * 257 / 2, 1),
}
"""Steps whose predicted time each fit reports, so that drift between fits shows."""


def run_calibration(args: argparse.Namespace) -> tuple[Any, dict]:
    """A fresh fit (``engine.sim.calibrate``), with its predictions for
    :data:`REFERENCE_SHAPES` (ms) added to its summary."""
    t0 = time.perf_counter()
    cost, fit = calibrate(
        EngineConfig(**SERVER_ENGINE_DEFAULTS),
        args.steps_per_level,
        progress=lambda m: print(m, flush=True),
    )
    fit["reference_ms"] = {k: 1000 * cost.step_seconds(v) for k, v in REFERENCE_SHAPES.items()}
    print(
        f"calibrated in {time.perf_counter() - t0:.0f} s: held-out MAPE {fit['held_out_mape']:.1%}",
        flush=True,
    )
    return cost, fit


async def run_real(args: argparse.Namespace, i: int) -> tuple[list, dict, dict, list]:
    """Rate ``args.rates[i]`` through a fresh in-process engine: the requests, their
    latencies (:func:`real_latencies`), what the run left (``run_open``'s info) and the
    engine's step records."""
    target, _ = await start_engine(dict(SERVER_ENGINE_DEFAULTS))
    steps: list = []
    target.engine.on_step = steps.append
    reqs = window_requests(args, args.rates[i], i, f"v{args.rates[i]:g}")
    try:
        run, info = await run_open(target, reqs, cutoff_s=args.duration + args.drain)
    finally:
        await stop_engine(target)
    return reqs, real_latencies(run.records), info, steps


async def replay(args: argparse.Namespace, i: int, cost, fit: dict) -> tuple[dict, dict]:
    """Rate ``args.rates[i]`` through a fresh in-process engine and through the simulator
    with ``cost``: the row of the report, and the real run's latencies."""
    rate, cutoff = args.rates[i], args.duration + args.drain
    reqs, real, info, steps = await run_real(args, i)
    service = ServiceConfig(num_replicas=1, admission=False, engine=dict(SERVER_ENGINE_DEFAULTS))
    sim = Fleet(service, cost).run(sim_requests(reqs))
    row = compare(real, sim_latencies(sim, cutoff))
    step_error = step_errors(cost, steps)
    drift = step_error["all"]["total_predicted_over_real"]
    rescaled = compare(
        real, sim_latencies(Fleet(service, scaled(cost, 1 / drift)).run(sim_requests(reqs)), cutoff)
    )
    row.update(
        step_error=step_error,
        fit=fit,
        rescaled=rescaled,
        sensitivity=sensitivity(service, cost, reqs, cutoff, real),
        rate=rate,
        load=args.loads[i] if args.loads else None,
        cut_off=info["cut_off"],
        preemptions_real=info["preemptions"],
        preemptions_sim=sim.preemptions,
    )
    print(
        f"rate {rate}: attainment real {row['attainment_real']:.1%} sim "
        f"{row['attainment_sim']:.1%}; TTFT mean {row['ttft_mean']['real']:.2f} / "
        f"{row['ttft_mean']['sim']:.2f} s",
        flush=True,
    )
    return row, real


def run_all(args: argparse.Namespace, cost, fit: dict) -> dict[str, Any]:
    """Each rate right after a fit of its own (the first uses ``cost``, made just before);
    the calibration's engine and the replay's never run at the same time."""
    rows, reals, fit_now = [], [], fit
    for i in range(len(args.rates)):
        if i:
            cost, fit_now = run_calibration(args)
        row, real = asyncio.run(replay(args, i, cost, fit_now))
        rows.append(row)
        reals.append(real)
    again = None
    if len(args.rates) > REPEAT_INDEX:  # compare() with the second real run as "sim"
        again = compare(reals[REPEAT_INDEX], asyncio.run(run_real(args, REPEAT_INDEX))[1])
        again.update(rate=args.rates[REPEAT_INDEX], load=rows[REPEAT_INDEX]["load"])
    span = max(round(r * args.duration) for r in args.rates) + 2  # the highest rate's rows
    return {
        "fit": fit,
        "rows": rows,
        "repeat": again,
        "args": vars(args),
        "host": platform.node(),
        "trace": f"{TRACE.name} rows {args.window_start}+{span}, lengths / 8; {ATTRIBUTION}",
    }


def step_errors(cost, records: list) -> dict[str, Any]:
    """How the cost model predicts the replay's own steps (period against prediction),
    overall and for decode-only steps: separates cost-model error from schedule error.
    ``total_predicted_over_real``: the predicted seconds of all those steps over their
    measured seconds, the host's speed during the replay against the fit's."""
    out: dict[str, Any] = {}
    pairs = [
        (r, cost.step_seconds(StepShape.of_record(r.seqs, r.num_decodes)), p)
        for r, p in zip(records, periods(records))
        if p > 0
    ]
    for name, keep in (
        ("all", lambda r: True),
        ("decode_only", lambda r: r.num_prefill_tokens == 0),
    ):
        kept = [(pred, p) for r, pred, p in pairs if keep(r)]
        out[name] = {
            "steps": len(kept),
            "median_predicted_over_real": statistics.median(pred / p for pred, p in kept)
            if kept
            else None,
            "total_predicted_over_real": sum(pred for pred, _ in kept) / sum(p for _, p in kept)
            if kept
            else None,
        }
    return out


def scaled(cost, factor: float):
    """``cost`` with every coefficient multiplied by ``factor``."""
    return dataclasses.replace(cost, coefficients=tuple(c * factor for c in cost.coefficients))


SCALES = (0.95, 1.0, 1.05)
"""Cost-model scales for :func:`sensitivity`."""


def sensitivity(
    service: ServiceConfig, cost, reqs: list, cutoff_s: float, real: dict
) -> dict[str, Any]:
    """The same requests simulated with every cost coefficient scaled by each of
    :data:`SCALES`: mean TTFT and TPOT (s, over the requests that both this simulation
    and the real run finished, as :func:`compare` takes them) and attainment per scale,
    to show how much a step-time error moves the latencies at this load (queueing
    amplifies it)."""
    out = {}
    for f in SCALES:
        row = compare(
            real, sim_latencies(Fleet(service, scaled(cost, f)).run(sim_requests(reqs)), cutoff_s)
        )
        out[f"{f:g}"] = {
            "ttft_mean": row["ttft_mean"]["sim"],
            "tpot_mean": row["tpot_mean"]["sim"],
            "attainment": row["attainment_sim"],
        }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"expected duration: about {estimate_s(args) / 60:.0f} min", flush=True)
    cost, fit = run_calibration(args)
    if args.rates is None:
        capacity = simulated_capacity(args, cost)
        args.rates = [round(capacity * m, 2) for m in CAPACITY_MULTIPLES]
        args.loads = list(CAPACITY_MULTIPLES)
        print(f"simulated capacity {capacity:.2f} req/s: rates {args.rates}", flush=True)
    rep = run_all(args, cost, fit)
    md = markdown(rep)
    print(md)
    stem = "sim_validation_quick" if args.quick else "sim_validation"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text(md)
    rep["run"] = rp.run_record()
    (RESULTS / f"{stem}.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
