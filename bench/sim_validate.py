"""Validate ``iterserve simulate`` against the live server on this host, in three layers.

Run from the repository root (it prints its expected duration first)::

    python -m bench.sim_validate             # the full run
    python -m bench.sim_validate --quick     # shorter runs, two rounds

One ``iterserve serve --step-log`` server (one replica, admission on, a 70% interactive /
30% batch mix with the default classes' SLOs) serves everything; each real run is a
window of the conversation trace (lengths / 8) replayed open loop over HTTP at a
multiple of the server's capacity, and the runs are cut out of the one step log by time
(:func:`engine.core.step_log.window`). Before the runs and after them, the same probe
requests are served, to time the host's own drift.

1. **Decision fidelity.** Each run's log is replayed step for step
   (:mod:`deploy.sim.replay`: each simulated step costs what the real step of the same
   composition measured). Bar: per-request TTFT and TPOT within 2% (median absolute
   error) and 5% (p99); the first divergent step is named.
2. **Cost-model fidelity, within one run.** A fit on the first half of a run's steps
   predicts the second half's periods (:func:`deploy.sim.calibrate.holdout`). Bar, per
   step kind (decode, mixed, prefill): median absolute error at most 5%, p90 at most 10%.
   Beside it, the probe's step times at the start against the end.
3. **End to end, against the real system's own spread.** ``--rounds`` real runs per load
   (:data:`LOADS`), interleaved; each simulated with the fit of its own step log and its
   median time outside steps (:class:`deploy.sim.replay.OutsideSteps`; admission, router
   and scheduler as the server runs them). Bar: the simulated mean
   TTFT and TPOT within the real runs' min-max band widened by 5%, the p99 within the
   band widened by 10%. Where the real runs' own spread is wider than the bar, the
   report says so.

Output: ``bench/results/sim_validation.json`` and ``.md``, and the server's step log,
``sim_validation_steps.jsonl.gz`` (``_quick`` with --quick). The layers can be computed
again from them, with no real run::

    python -m bench.sim_validate --reanalyze bench/results/sim_validation.json \
        --step-log bench/results/sim_validation_steps.jsonl.gz
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.toolkit import RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.servers import Server, SystemSpec, model_dir
from bench.toolkit.simcheck import (
    BAND,
    CALIBRATION_RPS,
    MIX,
    SLO,
    STATS,
    WINDOW_START,
    capacity,
    closed,
    mix_target,
    probe_requests,
    serve,
    stats,
    window_requests,
)
from bench.toolkit.targets import http_client
from bench.toolkit.workload import ATTRIBUTION, TRACE
from deploy.config import ServiceConfig
from deploy.sim import replay as rpl
from deploy.sim.calibrate import fit_log, holdout
from deploy.sim.fleet import Fleet
from deploy.sim.twin import observed
from engine.core.step_log import STEP_KINDS, StepLog, window

LOADS = (0.3, 0.6, 0.85, 1.2)
"""Layer 3's loads, in multiples of the capacity measured at the start of the run."""
EXTRA_LOADS = (1.5,)
"""Loads run once more, for layer 1's range (0.3x to 1.5x)."""
COST_BARS = {"median_abs": 0.05, "p90_abs": 0.10}


# -- the real runs ------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[tuple[int, float]]:
    """(round, load) in the order run: the rounds interleaved, the extra loads once, in
    the middle round."""
    order = []
    for k in range(args.rounds):
        loads = list(LOADS)
        if k == args.rounds // 2:
            loads += list(EXTRA_LOADS)
        order += [(k, x) for x in (loads if k % 2 == 0 else loads[::-1])]
    return order


def expected_s(args: argparse.Namespace) -> float:
    runs = len(plan(args))
    return 60 + 2 * 40 + 45 + runs * (args.duration + 20)


# -- the three layers ---------------------------------------------------------------------


def layer1(log: StepLog, config: ServiceConfig, history: list) -> dict[str, Any]:
    rep = rpl.replay(log, config, history=history)
    c = rpl.compare(log, rep)
    return {
        "ttft_median_abs": c["ttft"]["median_abs"],
        "ttft_p99_abs": c["ttft"]["p99_abs"],
        "tpot_median_abs": c["tpot"]["median_abs"],
        "tpot_p99_abs": c["tpot"]["p99_abs"],
        "compared": c["ttft"]["compared"],
        "status_differs": len(c["status_differs"]),
        "steps": c["steps"],
        "within_bars": c["within_bars"],
        "divergence": c["divergence"],
    }


def scatter(log: StepLog) -> dict[str, dict[str, float | None]]:
    """The steps' own scatter, per kind: each step of the second half against the median
    period of the first half's steps of the same shape (kind, decodes, prefill tokens to
    the nearest 32), as |error|'s median and p90. No model of a step's shape predicts
    such steps better on average: where this exceeds a bar, the host's noise does."""
    half = len(log.steps) // 2

    def key(s):
        return (s.kind, s.num_decodes, round(s.num_prefill_tokens / 32))

    groups: dict[tuple, list[float]] = {}
    for s in log.steps[:half]:
        groups.setdefault(key(s), []).append(s.period)
    errs: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
    for s in log.steps[half:]:
        if key(s) in groups:
            m = statistics.median(groups[key(s)])
            errs[s.kind].append(abs(s.period - m) / s.period)
    out = {}
    for k, e in errs.items():
        e.sort()
        out[k] = {
            "count": len(e),
            "median_abs": statistics.median(e) if e else None,
            "p90_abs": e[min(len(e) - 1, math.ceil(0.9 * len(e)) - 1)] if e else None,
        }
    return out


def layer2(log: StepLog) -> dict[str, Any]:
    _, errors = holdout(log)
    out: dict[str, Any] = {
        kind: {
            **e,
            "within_bars": e["count"] > 0 and all(e[k] <= bar for k, bar in COST_BARS.items()),
        }
        for kind, e in errors.items()
    }
    out["scatter"] = scatter(log)
    return out


def layer3(log: StepLog, config: ServiceConfig) -> dict[str, Any]:
    t0 = rpl.origin(log)
    reqs = rpl.requests(log, t0)
    outside = rpl.OutsideSteps.of(log).fleet_args(reqs)
    sim = Fleet(config, fit_log(log), live_loads=True, **outside).run(reqs, rpl.cancels(log, t0))
    return {"real": stats(observed(log, t0)), "sim": stats(sim)}


def bands(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per load: the real runs' min-max band of each statistic, each simulation inside
    the widened band or not, and whether the real spread alone exceeds the bar."""
    out: dict[str, dict[str, Any]] = {}
    for load in sorted({r["load"] for r in runs if r["load"] in LOADS}):
        rows = [r for r in runs if r["load"] == load]
        entry: dict[str, Any] = {"runs": len(rows)}
        for m in STATS:
            real = [r["layer3"]["real"][m] for r in rows if r["layer3"]["real"][m] is not None]
            sims = [r["layer3"]["sim"][m] for r in rows if r["layer3"]["sim"][m] is not None]
            if not real or not sims:
                entry[m] = None
                continue
            widen = BAND[m.split("_")[1]]
            lo, hi = min(real), max(real)
            entry[m] = {
                "real_min": lo,
                "real_max": hi,
                "spread": hi / lo - 1 if lo > 0 else math.inf,
                "sim": sims,
                "within": all(lo * (1 - widen) <= s <= hi * (1 + widen) for s in sims),
                "spread_exceeds_bar": lo > 0 and hi / lo - 1 > widen,
            }
        out[f"{load:g}"] = entry
    return out


def drift(log: StepLog, probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Median probe step period per kind (ms), start against end, and end / start."""
    med = []
    for p in probes:
        part = window(log, p["start"], p["end"] + 0.001)
        by = {k: [s.period for s in v] for k, v in part.kinds().items()}
        med.append({k: 1000 * statistics.median(v) if v else None for k, v in by.items()})
    out = {}
    for k in STEP_KINDS:
        a, b = med[0][k], med[-1][k]
        out[k] = {"start_ms": a, "end_ms": b, "end_over_start": b / a if a and b else None}
    return out


# -- the report ---------------------------------------------------------------------------

YES = {True: "yes", False: "no", None: "-"}


def _pct(x: float | None) -> str:
    return rp.pct(x, "-", 1)


def markdown(rep: dict[str, Any]) -> str:
    runs = rep["runs"]
    lines = [
        "# The simulator against the live server (three layers)",
        "",
        f"Trace: {rep['trace']}. One `iterserve serve` replica with its step log, admission "
        f"on, classes {MIX} (interactive SLOs TTFT {SLO[0]} s, TPOT {SLO[1]} s). Capacity "
        f"{rep['capacity_rps']:.2f} req/s (simulated with the fit of a 30 s calibration run "
        f"at {CALIBRATION_RPS:g} req/s); "
        f"{len(runs)} runs of {rep['args']['duration']:g} s of arrivals.",
        "",
        "## 1. Decision fidelity: each run replayed step for step",
        "",
        "Per-request error of the replay against the server (median and p99 of |error|); "
        "bars 2% and 5%.",
        "",
        "| round | load | requests | TTFT median | TTFT p99 | TPOT median | TPOT p99 | "
        "status differs | steps real / sim / same composition | within bars | first "
        "divergent step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in runs:
        a = r["layer1"]
        st = a["steps"]
        d = a["divergence"]
        why = "none" if d is None else f"{d['step']}: {d['why']}"
        ok = a["within_bars"]
        lines.append(
            f"| {r['round']} | {r['load']:g} | {a['compared']} | {_pct(a['ttft_median_abs'])} | "
            f"{_pct(a['ttft_p99_abs'])} | {_pct(a['tpot_median_abs'])} | "
            f"{_pct(a['tpot_p99_abs'])} | {a['status_differs']} | {st['real']} / "
            f"{st['simulated']} / {st['matched']} | median {YES[ok['median']]}, p99 "
            f"{YES[ok['p99']]} | {why} |"
        )
    lines += [
        "",
        "## 2. Cost-model fidelity within each run",
        "",
        "A fit on the first half of the run's steps predicts the second half's periods; "
        "bars per kind: median |error| <= 5%, p90 <= 10%. The last column is the floor "
        "no model of a step's shape can beat: each later step against the median period of "
        "the earlier steps of its shape (`scatter` in bench/sim_validate.py).",
        "",
        "| round | load | "
        + " | ".join(f"{k}: steps, median, p90" for k in STEP_KINDS)
        + " | all kinds within bars | the steps' own scatter: median, p90 |",
        "|---:|---:|" + "---|" * (len(STEP_KINDS) + 2),
    ]
    for r in runs:
        e = r["layer2"]
        cells = [
            f"{e[k]['count']}, {_pct(e[k]['median_abs'])}, {_pct(e[k]['p90_abs'])}"
            if e[k]["count"]
            else "0"
            for k in STEP_KINDS
        ]
        met = all(e[k]["within_bars"] for k in STEP_KINDS if e[k]["count"])
        floor = "; ".join(
            f"{k} {_pct(e['scatter'][k]['median_abs'])}, {_pct(e['scatter'][k]['p90_abs'])}"
            for k in STEP_KINDS
            if e["scatter"][k]["count"]
        )
        lines.append(
            f"| {r['round']} | {r['load']:g} | "
            + " | ".join(cells)
            + f" | {YES[met]} | {floor or '-'} |"
        )
    lines += [
        "",
        "The host's own drift: the probe's median step period at the start and the end of the run.",
        "",
        "| kind | start (ms) | end (ms) | end / start |",
        "|---|---:|---:|---:|",
    ]
    for k, v in rep["drift"].items():
        ratio = "-" if v["end_over_start"] is None else f"{v['end_over_start']:.3f}"
        start, end = rp.fmt(v["start_ms"], ".3f", "-"), rp.fmt(v["end_ms"], ".3f", "-")
        lines.append(f"| {k} | {start} | {end} | {ratio} |")
    lines += [
        "",
        "## 3. End to end, against the real runs' own spread",
        "",
        "Each run simulated with the fit of its own step log. Bar: each simulated mean within "
        "the real runs' min-max band widened by 5%, each p99 by 10%.",
        "",
        "| load | statistic | real min | real max | real spread | simulated | within | "
        "real spread wider than the bar |",
        "|---:|---|---:|---:|---:|---|---|---|",
    ]
    for load, entry in rep["bands"].items():
        for m in STATS:
            b = entry[m]
            if b is None:
                lines.append(f"| {load} | {m} | - | - | - | - | - | - |")
                continue
            sims = ", ".join(f"{s:.3f}" for s in b["sim"])
            lines.append(
                f"| {load} | {m.replace('_', ' ')} (s) | {b['real_min']:.3f} | "
                f"{b['real_max']:.3f} | {b['spread']:.1%} | {sims} | {YES[b['within']]} | "
                f"{YES[b['spread_exceeds_bar']]} |"
            )
    lines += ["", "## Verdict", "", *rep["verdict"], ""]
    return "\n".join(lines)


def verdict(rep: dict[str, Any]) -> list[str]:
    runs = rep["runs"]
    l1 = [r for r in runs if all(r["layer1"]["within_bars"].values())]
    l2 = [
        r
        for r in runs
        if all(r["layer2"][k]["within_bars"] for k in STEP_KINDS if r["layer2"][k]["count"])
    ]
    noisy = [
        r
        for r in runs
        if any(
            (r["layer2"]["scatter"][k]["p90_abs"] or 0) > COST_BARS["p90_abs"]
            or (r["layer2"]["scatter"][k]["median_abs"] or 0) > COST_BARS["median_abs"]
            for k in STEP_KINDS
        )
    ]
    cells = [b for e in rep["bands"].values() for b in e.values() if isinstance(b, dict)]
    l3 = [b for b in cells if b["within"]]
    wide = [b for b in cells if not b["within"] and b["spread_exceeds_bar"]]
    return [
        f"- Layer 1: {len(l1)} of {len(runs)} runs within both bars.",
        f"- Layer 2: {len(l2)} of {len(runs)} runs with every step kind within both bars; "
        f"in {len(noisy)} runs the steps' own scatter (same shape, same run) already "
        "exceeds a bar for some kind.",
        f"- Layer 3: {len(l3)} of {len(cells)} statistics within the widened band; of those "
        f"outside, {len(wide)} at loads where the real runs' own spread is wider than the bar.",
    ]


# -- the command --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.parser("bench.sim_validate", __doc__)
    cli.add_quick(ap, "20 s runs, two rounds")
    ap.add_argument("--rounds", type=int, default=None, help="real runs per load (default 3)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run")
    ap.add_argument(
        "--drain-allowance",
        type=float,
        default=30.0,
        help="seconds a run may take past its last arrival",
    )
    ap.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="keep the server's step log here (default: a temporary file)",
    )
    ap.add_argument(
        "--reanalyze",
        default=None,
        metavar="JSON",
        help="no real runs: recompute the layers from a result file and its --step-log",
    )
    args = ap.parse_args(argv)
    if args.reanalyze and not args.step_log:
        ap.error("--reanalyze needs the --step-log that run kept")
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.duration = args.duration or (20.0 if args.quick else 60.0)
    return args


async def real_runs(args: argparse.Namespace, server: Server, log_path: Path) -> dict[str, Any]:
    async with http_client() as client:
        target = mix_target(client, server.url)
        probes = [await closed(target, probe_requests(1), 4)]
        warm = await serve(target, window_requests(CALIBRATION_RPS, 30.0, 9, "cal"), 60.0)
        log = window(StepLog.read(log_path), warm["start"], warm["end"] + 0.5)
        config = rpl.service_config(log)
        outside = rpl.OutsideSteps.of(log)
        cap = capacity(fit_log(log), config, 60.0, outside)
        print(f"capacity (simulated, from the calibration run): {cap:.2f} req/s", flush=True)
        spans = []
        for n, (k, load) in enumerate(plan(args)):
            reqs = window_requests(cap * load, args.duration, 10 + n, f"v{n}")
            span = await serve(target, reqs, args.duration + args.drain_allowance)
            spans.append({"round": k, "load": load, "rate": cap * load, **span})
            print(
                f"run {n + 1}/{len(plan(args))}: load {load:g} ({cap * load:.2f} req/s), "
                f"{span['statuses']}, {span['end'] - span['start']:.0f} s",
                flush=True,
            )
            await asyncio.sleep(1.0)
        probes.append(await closed(target, probe_requests(1), 4))
    return {"capacity": cap, "spans": spans, "probes": probes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    what = f"{len(plan(args))} real runs of {args.duration:g} s"
    cli.expected("sim_validate", expected_s(args), what)
    t_begin = time.perf_counter()
    recorded, recorded_wall = None, 0.0
    if args.reanalyze:
        before = json.loads(Path(args.reanalyze).read_text())
        real, recorded, recorded_wall = before["real"], before["run"], before["wall_s"]
        log = StepLog.read(args.step_log)
    else:
        with tempfile.TemporaryDirectory(prefix="sim-validate-") as tmp:
            log_path = Path(args.step_log or Path(tmp) / "steps.jsonl")
            log_path.unlink(missing_ok=True)
            spec = SystemSpec("iterserve", "iterserve", service={"step_log": str(log_path)})
            with Server(spec, model_dir(), mix=True, slo=SLO) as server:
                real = asyncio.run(real_runs(args, server, log_path))
            log = StepLog.read(log_path)
            name = "sim_validation_quick" if args.quick else "sim_validation"
            kept = RESULTS / f"{name}_steps.jsonl.gz"
            with log_path.open("rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
    config = rpl.service_config(log)
    runs = []
    for span in real["spans"]:
        part = window(log, span["start"], span["end"] + 0.5)
        before = [s for s in log.steps if s.start < span["start"]]
        row = {k: span[k] for k in ("round", "load", "rate", "statuses")}
        row.update(
            layer1=layer1(part, config, before), layer2=layer2(part), layer3=layer3(part, config)
        )
        runs.append(row)
        print(
            f"load {span['load']:g} round {span['round']}: replay TTFT median "
            f"{_pct(row['layer1']['ttft_median_abs'])}; first divergence "
            f"{(row['layer1']['divergence'] or {}).get('step')}",
            flush=True,
        )
    rep: dict[str, Any] = {
        # Reanalyzed: the real runs' record stays; the analysis has its own.
        "run": recorded or rp.run_record(),
        **({"analysis": rp.run_record()} if recorded else {}),
        "trace": f"{TRACE.name} from row {WINDOW_START}, lengths / 8; {ATTRIBUTION}",
        "args": vars(args),
        "capacity_rps": real["capacity"],
        "runs": runs,
        "bands": bands(runs),
        "drift": drift(log, real["probes"]),
        "real": real,
        "wall_s": recorded_wall if recorded else time.perf_counter() - t_begin,
    }
    rep["verdict"] = verdict(rep)
    name = "sim_validation_quick" if args.quick else "sim_validation"
    rp.write_report(RESULTS / f"{name}.json", rep, markdown(rep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
