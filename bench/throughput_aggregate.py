"""The offline throughput benchmark's results (``bench/engine_throughput.py``): the workers'
runs aggregated per system, the ratios against the targets, greedy agreement between systems
and runs, and the whole report as written to the JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

CONTENTION_CORES = 0.25  # other processes' average load above which a measurement is flagged
TARGETS = {
    "iterserve_over_hf_generate_batch": 2.0,
    "iterserve_over_hf_generate": 1.5,
    "decode_pct_roofline_at_64": 50.0,
    "sched_prep_pct_at_64": 5.0,
}
METHOD = {
    "wall_time": "generation only (model load, KV allocation and a tiny warm-up excluded)",
    "output_tok_s": "sum of each request's own output length / wall",
    "total_tok_s": "(prompt tokens + output tokens) / wall",
    "peak_rss": "resource.getrusage(RUSAGE_SELF).ru_maxrss in each system's own "
    "subprocess, one subprocess per (system, run)",
    "run_order": "interleaved: run i of every system, then run i+1",
}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def median(xs):
    """The median of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many requests got identical greedy tokens, and where the others first diverge."""
    firsts = []
    for x, y in zip(a, b):
        if x != y:
            firsts.append(
                next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            )
    return {
        "requests": len(a),
        "identical": len(a) - len(firsts),
        "first_divergence_positions": sorted(firsts),
    }


def greedy_agreement(runs: dict[str, list[dict]], systems: list[str]) -> dict:
    """Agreement of each pair of systems (first good run each), then of each system's later
    runs with its first."""
    greedy = {}
    first_ok = {n: next((r for r in rs if "error" not in r), None) for n, rs in runs.items()}
    names = [n for n in systems if first_ok[n] is not None]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            greedy[f"{a} vs {b}"] = agreement(first_ok[a]["token_ids"], first_ok[b]["token_ids"])
    for n in names:  # run-to-run determinism of each system
        for k, r in enumerate(runs[n]):
            if "error" not in r and r is not first_ok[n]:
                greedy[f"{n} run 1 vs run {k + 1}"] = agreement(
                    first_ok[n]["token_ids"], r["token_ids"]
                )
    return greedy


def _aggregate_one(rs: list[dict]) -> dict:
    ok = [r for r in rs if "error" not in r]
    errors = [r["error"] for r in rs if "error" in r]
    entry = {
        "runs_ok": len(ok),
        "errors": errors,
        "output_tok_s_runs": [r.get("output_tok_s") for r in rs],
        "total_tok_s_runs": [r.get("total_tok_s") for r in rs],
        "wall_s_runs": [r.get("wall_s") for r in rs],
        "peak_rss_mib_runs": [r.get("peak_rss_mib") for r in rs],
        "output_tok_s_median": median(r["output_tok_s"] for r in ok),
        "total_tok_s_median": median(r["total_tok_s"] for r in ok),
        "wall_s_median": median(r["wall_s"] for r in ok),
        "peak_rss_mib_max": max(
            (r["peak_rss_mib"] for r in rs if "peak_rss_mib" in r), default=None
        ),
        "rss_after_load_mib": median(r.get("rss_after_load_mib") for r in ok),
        "setup_s_median": median(r.get("setup_s") for r in ok),
        "foreign_cores_runs": [r.get("foreign_cores") for r in rs],
        "own_cores_runs": [r.get("own_cores") for r in rs],
        "torch_threads": next((r["torch_threads"] for r in rs if "torch_threads" in r), None),
    }
    for key in (
        "output_tokens_computed",
        "preemptions",
        "ttft_s_p50",
        "e2e_s_p50",
        "manager_setup_s",
        "note",
        "resolved_config",
    ):
        vals = [r[key] for r in ok if key in r]
        if vals:
            entry[key] = vals[0] if key in ("note", "resolved_config") else vals
    if ok:
        entry["output_tokens"] = ok[0]["output_tokens"]
        entry["prompt_tokens"] = ok[0]["prompt_tokens"]
    if errors:
        entry["stderr_tail"] = next(r.get("stderr_tail", "") for r in rs if "error" in r)
        entry["traceback"] = next(r.get("traceback", "") for r in rs if "error" in r)
    return entry


def aggregate(runs: dict[str, list[dict]]) -> dict:
    return {name: _aggregate_one(rs) for name, rs in runs.items()}


def ratios(systems: dict, runs: int) -> dict:
    res = {}
    base = systems.get("iterserve")
    for other in ("hf_generate_batch", "hf_generate", "iterserve_noprepack"):
        if base is None or other not in systems:
            continue
        per_run = []
        for i in range(runs):
            a = base["output_tok_s_runs"][i]
            b = systems[other]["output_tok_s_runs"][i]
            per_run.append(a / b if a and b else None)
        key = f"iterserve_over_{other}"
        med = median(per_run)
        a, b = base["output_tok_s_median"], systems[other]["output_tok_s_median"]
        target = TARGETS.get(key)
        res[key] = {
            "per_run": per_run,
            "median": med,
            "ratio_of_medians": a / b if a and b else None,
            "target": target,
            "met": None if med is None or target is None else med >= target,
        }
    return res


def _target_met(report: dict, sweep: dict | None) -> None:
    """``report["target_met"]``: the decode targets at 64 sequences, then the ratios'."""
    if sweep and "points" in sweep:
        at64 = next((p for p in sweep["points"] if p["num_seqs"] == 64), None)
        if at64:
            report["target_met"] = {
                "decode_pct_roofline_at_64": at64["pct_roofline"]
                >= TARGETS["decode_pct_roofline_at_64"],
                "sched_prep_pct_at_64": at64["sched_prep_pct"] <= TARGETS["sched_prep_pct_at_64"],
            }
    for name, r in report["ratios"].items():
        report.setdefault("target_met", {})[name] = r["met"]


def contention(report: dict, sweep: dict | None) -> bool:
    """Flag (``report["contention_warning"]``) the measurements other processes disturbed;
    True when there are any."""
    agg = report["systems"]
    loads = [
        (f"{n} run {i + 1}", x)
        for n, e in agg.items()
        for i, x in enumerate(e["foreign_cores_runs"])
        if x is not None
    ]
    if sweep and "points" in sweep:
        loads += [
            (f"sweep {p['num_seqs']} seqs", p["foreign_cores"])
            for p in sweep["points"]
            if p.get("foreign_cores") is not None
        ]
    # A worker with T threads on C cores is undisturbed while others use at most C - T cores.
    threads = report["machine"]["torch_threads"] or os.cpu_count() or 1
    spare = max(0, (os.cpu_count() or 1) - threads)
    busy = [(what, x) for what, x in loads if x > spare + CONTENTION_CORES]
    if busy:
        report["contention_warning"] = (
            "other processes kept "
            + ", ".join(f"{x:.2f} cores busy during {what}" for what, x in busy)
            + f"; with {os.cpu_count()} cores and {threads} torch threads per worker, a run can "
            "slow down several-fold when another process takes a core it needs. Re-run on an "
            "idle machine, or with --threads 1."
        )
    return bool(busy)


def _machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


def assemble(
    args: argparse.Namespace,
    wl: dict,
    stats: dict,
    configs: dict,
    runs: dict[str, list[dict]],
    sweeps: tuple[dict | None, dict | None],
    greedy: dict,
    t_start: float,
) -> dict:
    """The report written to the JSON, ``target_met`` included (not the contention flag)."""
    agg = aggregate(runs)
    sweep, sweep_plain = sweeps
    report = {
        "benchmark": "engine_throughput",
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "runs": args.runs,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "model": "SmolLM2-135M-Instruct (embedded GGUF, de-quantised to fp32)",
        "trace": wl["trace"],
        "workload": stats,
        "config": configs,
        "method": dict(METHOD),
        "systems": agg,
        "ratios": ratios(agg, args.runs),
        "decode_sweep": sweep,
        "decode_sweep_noprepack": sweep_plain,
        "targets": TARGETS,
        "greedy_agreement": greedy,
        "elapsed_s": time.perf_counter() - t_start,
    }
    report["machine"]["torch_threads"] = next(
        (s["torch_threads"] for s in agg.values() if s["torch_threads"]),
        (sweep or {}).get("torch_threads"),
    )
    _target_met(report, sweep)
    return report
