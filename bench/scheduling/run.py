"""The scheduling suite's command line and run (:mod:`bench.scheduling`): options, the
expected duration, the steps in order, the result file."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.scheduling.experiments import admission_experiment, exp_chunk, exp_priority, variants
from bench.scheduling.report import TARGETS, markdown, plots, targets
from bench.scheduling.sweep import CONFIGS, measure_capacity, run_config
from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.workload import ATTRIBUTION, Lengths, Window

FULL_CONFIGS = ("static", "cont-chunk", "cont-chunk+adm")
QUICK_CONFIGS = FULL_CONFIGS
EXPERIMENTS = ("chunk", "admission", "priority")
ENGINE_START_S = 3.0


def estimate_s(args: argparse.Namespace) -> float:
    """Expected wall seconds of a run with these options (printed before it starts)."""
    per_point = args.duration + 0.5 * args.drain + 2
    t = 0.0 if args.capacity else args.capacity_duration + ENGINE_START_S + 3
    t += len(args.config_list) * (ENGINE_START_S + len(args.loads) * per_point)
    # An extra low point is expected for static only; refinement for every config.
    t += min(args.extra_low_points, 1) * ("static" in args.config_list) * per_point
    t += args.goodput_refine * len(args.config_list) * per_point
    if "chunk" in args.experiment_list:
        t += len(variants(args)) * (ENGINE_START_S + 15 + 6 * args.long_repeats)
    if "priority" in args.experiment_list:
        if args.priority_scale != args.prompt_scale and not args.priority_capacity:
            t += args.capacity_duration + ENGINE_START_S + 3
        nl = len(args.interactive_loads)
        runs = 2 * nl + args.priority_repeats * (1 + nl) + 1
        t += runs * (ENGINE_START_S + args.priority_duration + 5)
    return t


def _parser() -> argparse.ArgumentParser:
    # The suite's description is the package's docstring; imported here, since the package
    # imports this module.
    from bench import scheduling

    ap = cli.parser("bench.scheduling", scheduling.__doc__)
    add = ap.add_argument
    cli.add_quick(ap, "smoke run: loads 0.5,2; 15 s per point; admission experiment only")
    add("--duration", type=float, help="seconds of arrivals per point (30; quick 15)")
    add("--drain", type=float, help="cut-off after the last arrival, s (40; quick 6)")
    add("--loads", help="multiples of capacity (0.25,0.5,1,1.5; quick 0.5,2)")
    add(
        "--configs",
        help=f"subset of {','.join(CONFIGS)}, or 'none' (default {','.join(FULL_CONFIGS)})",
    )
    add(
        "--experiments",
        help=f"subset of {','.join(EXPERIMENTS)}, or 'none' (default all; quick: admission)",
    )
    add("--capacity", type=float, help="capacity in req/s; skips the measurement")
    add("--capacity-concurrency", type=int, default=12)
    add("--capacity-duration", type=float, help="closed-loop seconds (20; quick 10)")
    add("--capacity-rows", type=int, default=200, help="window rows cycled by the closed loop")
    cli.add_window_start(ap, 0)
    add("--window-rows", type=int, default=4000)
    add("--prompt-scale", type=float, default=8.0)
    add("--output-scale", type=float, default=8.0)
    add("--interactive-frac", type=float, default=0.7)
    add(
        "--extra-low-points",
        type=int,
        help="points at half the lowest load when it misses 90%% (1; quick 0)",
    )
    add("--goodput-refine", type=int, help="points halving each goodput bracket (0)")
    add("--chunk-budget", type=int, default=128, help="max_num_batched_tokens with chunking")
    add(
        "--nochunk-budget",
        type=int,
        default=2048,
        help="max_num_batched_tokens without (raised to the longest prompt)",
    )
    add("--max-num-seqs", type=int, default=64)
    add("--num-kv-blocks", type=int, default=1024)
    add("--long-prompt", type=int, default=1024)
    add("--long-repeats", type=int, help="chunk experiment: long prompts (2; quick 1)")
    add("--decoders", type=int, default=4)
    add("--chunk-variants", default="off,128,16", help="'off' and/or chunk budgets")
    add("--batch-load", type=float, default=2.0, help="priority: batch traffic x capacity")
    add("--interactive-loads", default="0.05", help="priority: interactive traffic x capacity")
    add("--priority-scale", type=float, default=16.0, help="priority: both length divisors")
    add("--priority-capacity", type=float, help="priority: capacity, skips its measurement")
    add("--priority-duration", type=float, help="priority: seconds of arrivals (30)")
    add("--priority-repeats", type=int, help="priority: alone/mixed run pairs (2; quick 1)")
    add("--interactive-offset-rows", type=int, default=3000)
    add("--no-tpot-guard", action="store_true", help="turn the TPOT SLO guard off everywhere")
    add("--tpot-guard-target", type=float, help="EngineConfig.tpot_slo_guard_target")
    add("--threads", type=int, help="torch.set_num_threads")
    add(
        "--step-log", type=Path, help="append the engine's step log (engine.core.step_log's format)"
    )
    cli.add_seed(ap)
    cli.add_trace(ap, Path)
    cli.add_out(ap, None, "JSON path (bench/results/scheduling[_quick].json)", type=Path)
    return ap


def _names(text: str | None, default: tuple[str, ...], known, what: str, ap) -> list[str]:
    text = text or ",".join(default)
    names = [] if text == "none" else [x.strip() for x in text.split(",") if x.strip()]
    if bad := set(names) - set(known):
        ap.error(f"unknown {what} {sorted(bad)}; known: {', '.join(known)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    ap = _parser()
    a = ap.parse_args(argv)
    q = a.quick

    def pick(value, full, quick):
        return value if value is not None else (quick if q else full)

    a.duration = pick(a.duration, 30.0, 15.0)
    a.drain = pick(a.drain, 40.0, 6.0)
    a.capacity_duration = pick(a.capacity_duration, 20.0, 10.0)
    a.priority_duration = pick(a.priority_duration, 30.0, 30.0)
    a.priority_repeats = pick(a.priority_repeats, 2, 1)
    a.long_repeats = pick(a.long_repeats, 2, 1)
    a.extra_low_points = pick(a.extra_low_points, 1, 0)
    a.goodput_refine = pick(a.goodput_refine, 0, 0)
    a.loads = [float(x) for x in pick(a.loads, "0.25,0.5,1,1.5", "0.5,2").split(",")]
    a.interactive_loads = [float(x) for x in a.interactive_loads.split(",") if x.strip()]
    a.config_list = _names(a.configs, QUICK_CONFIGS if q else FULL_CONFIGS, CONFIGS, "configs", ap)
    a.experiment_list = _names(
        a.experiments, ("admission",) if q else EXPERIMENTS, EXPERIMENTS, "experiments", ap
    )
    a.out = a.out or RESULTS / ("scheduling_quick.json" if q else "scheduling.json")
    return a


def window(args: argparse.Namespace, scale: float) -> Window:
    lengths = Lengths(scale, scale, 4, 1024, 2, 128)
    mix = {"interactive": args.interactive_frac, "batch": 1 - args.interactive_frac}
    return Window(args.trace, args.window_start, args.window_rows, lengths, mix, args.seed)


async def capacity_of(
    wl: Window, args: argparse.Namespace, given: float | None, what: str
) -> dict[str, Any]:
    """``given`` req/s, or measured by :func:`measure_capacity`."""
    if given:
        return {"rps": given, "source": "given"}
    print(
        f"# measuring capacity{what}: {args.capacity_concurrency} closed-loop clients for "
        f"{args.capacity_duration:g} s on cont-chunk-fixed ...",
        flush=True,
    )
    m = await measure_capacity(wl, args)
    print(
        f"# capacity{what} {m['measured_rps']:.3f} req/s ({m['output_tok_s']:.1f} out "
        f"tok/s); step-model SLO capacity {rp.fmt(m['model_slo_rps'], '.3f')} req/s",
        flush=True,
    )
    return {"rps": m["measured_rps"], "source": m["method"], **m}


def problems_of(sweep: dict, experiments: dict) -> list[str]:
    """Leaked KV blocks, engine errors, failed or wrong-length requests, anywhere."""
    out = []
    for name, res in sweep.items():
        for p in res["points"]:
            where, s = f"{name} @ {p['load_x']:g}x", p["summary"]
            if not p["blocks_ok"]:
                out.append(
                    f"{where}: KV blocks leaked ({p['blocks_free']}/{p['blocks_total']} free)"
                )
            if p.get("engine_error"):
                out.append(f"{where}: engine loop failed: {p['engine_error']}")
            if s["failed"] or s["incomplete"]:
                errs = sorted(
                    {r.get("error") or "" for r in p["records"] if r["status"] == "error"}
                )
                out.append(
                    f"{where}: {s['failed']} failed, {s['incomplete']} wrong length {errs[:2]}"
                )
    runs = dict((experiments.get("chunk") or {}).get("variants") or {})
    pr = experiments.get("priority") or {}
    runs.update({f"batch-alone#{k}": r for k, r in enumerate(pr.get("batch_alone") or [])})
    for key, st in (pr.get("interactive") or {}).items():
        for r in [*st["priority"], *st["alone"], *([st["fcfs"]] if st["fcfs"] else [])]:
            runs[f"{r['engine']['policy']}@{key}x#{len(runs)}"] = r
    for name, r in runs.items():
        if not r.get("blocks_ok", True) or r.get("error") or r.get("engine_error"):
            out.append(
                f"{name}: blocks_ok={r.get('blocks_ok')} "
                f"{r.get('error') or r.get('engine_error') or ''}"
            )
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from policies import DEFAULT_CLASSES

    wl = window(args, args.prompt_scale)
    args.nochunk_budget = max(args.nochunk_budget, wl.lengths.max_prompt)
    t_start, est = time.perf_counter(), estimate_s(args)
    cli.expected(
        "scheduling",
        est,
        f"configs {args.config_list or 'none'}, loads {args.loads} x capacity, experiments "
        f"{args.experiment_list or 'none'}; {args.duration:g} s per point, up to "
        f"{args.drain:g} s drain",
    )
    capacity = await capacity_of(wl, args, args.capacity, "")
    sweep = {name: await run_config(wl, args, capacity["rps"], name) for name in args.config_list}
    experiments: dict[str, Any] = {}
    if "chunk" in args.experiment_list:
        experiments["chunk"] = await exp_chunk(wl, args)
    if "admission" in args.experiment_list:
        experiments["admission"] = admission_experiment(sweep)
    if "priority" in args.experiment_list:
        s = args.priority_scale
        pwl, pcap = wl, capacity
        if s != args.prompt_scale or s != args.output_scale:
            pwl = window(args, s)
            pcap = await capacity_of(pwl, args, args.priority_capacity, f" (lengths / {s:g})")
        experiments["priority"] = {**await exp_priority(pwl, args, pcap["rps"]), "capacity": pcap}
    import torch

    first, last = wl.rows[0], wl.rows[wl.max_row_used - args.window_start]
    report = {
        "benchmark": "scheduling",
        "quick": args.quick,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            **rp.machine(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "model": "SmolLM2-135M-Instruct (embedded), fp32 on CPU",
        "trace": {
            "file": os.path.relpath(args.trace, REPO),
            "attribution": ATTRIBUTION,
            "window": f"rows {first.row}-{last.row} ({first.timestamp} .. "
            f"{last.timestamp}); per point the first round(rate x duration) "
            "rows, arrivals rescaled to the rate",
            "scaling": wl.lengths.describe(),
            "mix": f"{100 * args.interactive_frac:.0f}% interactive per row",
        },
        "classes": {
            k: {"ttft_slo_s": v.ttft_slo_s, "tpot_slo_s": v.tpot_slo_s}
            for k, v in DEFAULT_CLASSES.items()
            if k in ("interactive", "batch")
        },
        "capacity": capacity,
        "loads_x": args.loads,
        "duration_s": args.duration,
        "drain_s": args.drain,
        "configs": {n: CONFIGS[n]["desc"] for n in args.config_list},
        "sweep": sweep,
        "experiments": experiments,
        "targets_spec": TARGETS,
        "problems": problems_of(sweep, experiments),
    }
    report["targets"] = targets(report)
    report["elapsed_s"], report["estimated_s"] = time.perf_counter() - t_start, est
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = asyncio.run(amain(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        report["plots"] = plots(report, args.out.with_suffix(""))
    except Exception as e:  # noqa: BLE001 - plots are a convenience
        report["plots_error"] = repr(e)
    rp.write_report(args.out, report, markdown(report))
    print(f"{report['elapsed_s']:.0f} s in all; expected {report['estimated_s']:.0f} s")
    return 0
