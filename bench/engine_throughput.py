"""Offline throughput of iterserve against transformers' two batch APIs, plus a decode sweep.

Run from the repository root::

    python -m bench.engine_throughput            # full run, 3 runs (make bench)
    python -m bench.engine_throughput --quick    # tiny smoke run

Workload
    Request lengths come from the Azure LLM inference trace 2023, conversation service
    (``deploy/sim/traces/azure_llm_2023_conv.csv``, shipped with the package; columns
    TIMESTAMP, ContextTokens, GeneratedTokens; CC-BY 4.0, published with Splitwise, Patel et al.,
    ISCA 2024). The window is the first ``--num-requests`` rows (default 64, i.e. rows 0-63,
    about the first 32 s of the trace), starting at ``--window-start`` (default 0). Arrival times
    are ignored: every request is submitted at once (offline batch throughput). Lengths are scaled
    so that one run of all three systems takes a few minutes on a 2-core CPU:
    prompt = round(ContextTokens / 16) clamped to [1, 256], output = round(GeneratedTokens / 8)
    clamped to [1, 64] (``--prompt-scale``, ``--output-scale``, ``--max-prompt``,
    ``--max-output``). For rows 0-63 that is 2842 prompt tokens (p50 24, max 255) and 1009
    output tokens (p50 14.5, max 50). Prompt token ids are drawn
    uniformly from [1000, 40000) by ``random.Random(seed)``, so every system and run gets the
    same requests. Each request produces exactly its output length: iterserve with
    ``SamplingParams(max_tokens=L, temperature=0, ignore_eos=True)``, transformers with EOS
    stopping disabled (and ``min_new_tokens = max_new_tokens``); greedy everywhere.

Systems (same requests, same process layout, fp32 on CPU, the embedded SmolLM2-135M-Instruct)
    iterserve          ``LLM.generate`` on all requests at once (continuous batching, chunked
                       prefill, paged KV: max_num_seqs 64, max_num_batched_tokens 512, block 16,
                       1024 KV blocks = 16384 tokens); linear layers on weights
                       prepacked for oneDNN (``cpu_weight_prepack``, the default).
    iterserve_noprepack  the same with ``cpu_weight_prepack=False``: torch's ``nn.Linear``
                       (MKL sgemm), to measure what prepacking gives in the same run.
    hf_generate        transformers' ``model.generate`` with static batches of ``--hf-batch-size``
                       (8) taken in trace order, left-padded (pad = EOS), max_new_tokens = the
                       largest output length of the batch. Only each request's own L tokens count
                       as output tokens; the rest is the price of static batching.
    hf_generate_batch  transformers' continuous batching (``generate_batch``'s manager), sized
                       like iterserve: page_size 16, num_blocks 1024, max_batch_tokens 512,
                       max_requests_per_batch 64, SDPA attention, no prefix sharing, no compile.
                       ``generate_batch`` takes one max_new_tokens for all requests, so by
                       default the benchmark drives the same manager it builds
                       (``continuous_batching_context_manager`` + ``add_request`` with each
                       request's own max_new_tokens and EOS disabled); ``--hf-cb-api
                       generate_batch`` calls ``generate_batch`` itself with max_new_tokens = the
                       largest L and counts only the useful tokens.

    Every (system, run) runs in its own subprocess, so peak RSS (``ru_maxrss``) is per system and
    includes the model weights; runs are interleaved (run 1 of each system, then run 2, ...) so
    the per-run ratios compare systems measured close in time. Wall time covers generation only:
    model load, KV allocation and one tiny warm-up call of the same API are excluded.

Decode sweep
    iterserve decode tokens/s with 1, 8, 32 and 64 running sequences (16-token prompts),
    stepping ``llm.llm_engine`` by hand: only steps in which every sequence is decoding count
    (the first two such steps are skipped as warm-up). The roofline is fp32 GEMM FLOP/s (median
    of ``torch.mm`` on 2048x2048 matrices) divided by 2 x the model's parameter count (tied
    embeddings counted once: the LM head is the one matmul they take part in). Each step's
    times come from the ``engine.StepRecord`` the engine's step listener receives: the whole
    step (``seconds``), ``scheduler.schedule()`` (``schedule_s``) and the runner's own
    prepare / forward / sample breakdown of its ``execute`` (``phases``, perf_counter in
    ``TorchModelRunner``); "other" is the rest of the step (updating requests, detokenizing,
    outputs). Scheduling + input preparation as a fraction of the step is reported, with a
    target at 64 sequences. The sweep runs twice, with and without weight prepacking
    (``decode_sweep_noprepack``). iterserve's preemption count is the scheduler's
    ``num_preemptions`` over the timed run.

Code
    This module holds, in order: the workload and each system's config; the aggregation,
    ratios, greedy agreement and JSON report; the markdown report; the command line and the
    run itself (interleaving the systems' runs, the sweeps). The workers (iterserve's,
    transformers' two, the decode sweep) and the subprocess each runs in
    (``python -m bench.toolkit.workers NAME``, started by :func:`bench.toolkit.workers.spawn`)
    are in :mod:`bench.toolkit.workers`.

Noise
    This machine is shared. Each timed section also records the cores this worker kept busy and
    the cores other processes kept busy (``/proc/stat`` minus this process's CPU time); runs where
    others took a core this run needed are flagged. With 2 cores and torch's default of 2 threads,
    one foreign busy process can slow a run several-fold; ``--threads 1`` makes every worker
    single-threaded (slower, but far less sensitive).

Output
    A markdown table on stdout and ``bench/results/engine_throughput.json``
    (``engine_throughput_quick.json`` with ``--quick``). Targets are printed beside the
    measurements, never asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.report import fmt
from bench.toolkit.workers import spawn
from bench.toolkit.workload import ATTRIBUTION, TOKEN_ID_RANGE, Lengths, read_trace


# The workload: the trace window as token-id prompts, and each system's config.
def _trace_info(args: argparse.Namespace, first: str, last: str, raw: list[tuple[int, int]]):
    """The report's description of the trace window and of how its lengths were scaled."""
    return {
        "file": os.path.relpath(args.trace, REPO),
        "attribution": ATTRIBUTION,
        "window": (
            f"rows {args.window_start}-{args.window_start + args.num_requests - 1} "
            f"({args.num_requests} requests, TIMESTAMP {first} .. {last}); arrival times "
            "ignored, all submitted at once"
        ),
        "prompt_len": f"round(ContextTokens / {args.prompt_scale:g}) "
        f"clamped to [1, {args.max_prompt}]",
        "output_len": f"round(GeneratedTokens / {args.output_scale:g}) "
        f"clamped to [1, {args.max_output}]",
        "prompt_scale": args.prompt_scale,
        "output_scale": args.output_scale,
        "max_prompt": args.max_prompt,
        "max_output": args.max_output,
        "prompt_token_ids": f"uniform in [{TOKEN_ID_RANGE[0]}, {TOKEN_ID_RANGE[1]}), "
        f"random.Random({args.seed})",
        "raw_context_tokens_total": sum(c for c, _ in raw),
        "raw_generated_tokens_total": sum(g for _, g in raw),
    }


def build_workload(args: argparse.Namespace) -> dict:
    """Read the trace window, scale the lengths and make deterministic prompt token ids."""
    if not Path(args.trace).is_file():
        raise SystemExit(
            f"trace not found: {args.trace} (the shipped ones are in deploy/sim/traces/)"
        )
    window = read_trace(args.trace, args.window_start, args.num_requests)[: args.num_requests]
    lengths = Lengths(args.prompt_scale, args.output_scale, 1, args.max_prompt, 1, args.max_output)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(*TOKEN_ID_RANGE) for _ in range(lengths.prompt(r.context_tokens))]
        for r in window
    ]
    out_lens = [lengths.output(r.generated_tokens) for r in window]
    raw = [(r.context_tokens, r.generated_tokens) for r in window]
    return {
        "prompts": prompts,
        "output_lens": out_lens,
        "trace": _trace_info(args, window[0].timestamp, window[-1].timestamp, raw),
    }


def workload_stats(wl: dict) -> dict:
    p = [len(x) for x in wl["prompts"]]
    o = wl["output_lens"]
    return {
        "num_requests": len(p),
        "prompt_tokens_total": sum(p),
        "output_tokens_total": sum(o),
        "prompt_len_p50": statistics.median(p),
        "prompt_len_max": max(p),
        "output_len_p50": statistics.median(o),
        "output_len_max": max(o),
    }


def _iterserve_config(args: argparse.Namespace) -> dict:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_tokens": args.num_kv_blocks * args.block_size,
        "dtype": "float32",
        "quantization": "none",
        "cpu_weight_prepack": True,
    }


def _hf_generate_config(args: argparse.Namespace) -> dict:
    return {
        "batch_size": args.hf_batch_size,
        "batching": "static, trace order, left-padded with pad=eos, "
        "max_new_tokens = max L of the batch",
        "attn_implementation": "sdpa",
        "eos": "disabled (model.generation_config.eos_token_id=None), "
        "min_new_tokens = max_new_tokens",
        "dtype": "float32",
    }


def _hf_generate_batch_config(args: argparse.Namespace) -> dict:
    return {
        "api": args.hf_cb_api,
        "api_note": (
            "continuous_batching_context_manager + add_request(max_new_tokens=L_i, "
            "eos_token_id=-1): the manager generate_batch builds, with per-request lengths"
            if args.hf_cb_api == "manager"
            else "model.generate_batch(max_new_tokens = max L for all requests); "
            "only each request's own L tokens are counted"
        ),
        "attn_implementation": "sdpa (CB accepts sdpa, paged|eager or flash; "
        "no flash on CPU; paged|sdpa is deprecated in 5.2x)",
        "page_size": args.block_size,
        "num_blocks": args.num_kv_blocks,
        "kv_tokens": args.num_kv_blocks * args.block_size,
        "max_batch_tokens": args.max_num_batched_tokens,
        "max_requests_per_batch": args.max_num_seqs,
        "allow_block_sharing": False,
        "auto_switch_to_flash": False,
        "scheduler_type": "fifo",
        "default_compile_level": 0,
        "max_memory_percent": "default (0.6 on CPU): only a cap here, since num_blocks and "
        "max_batch_tokens are fixed",
        "dtype": "float32",
    }


def system_configs(args: argparse.Namespace) -> dict:
    configs = {
        "iterserve": _iterserve_config(args),
        "hf_generate": _hf_generate_config(args),
        "hf_generate_batch": _hf_generate_batch_config(args),
    }
    configs["iterserve_noprepack"] = {**configs["iterserve"], "cpu_weight_prepack": False}
    return configs


def sweep_config(args: argparse.Namespace, iterserve: dict) -> dict:
    """The decode sweep's config: iterserve's (``iterserve``) plus the sweep's own."""
    return {
        **iterserve,
        "batch_sizes": [int(x) for x in args.sweep_sizes.split(",")],
        "prompt_len": 16,
        "token_id_range": TOKEN_ID_RANGE,
        "steps": args.sweep_steps,
        "warm_steps": 2,
        "gemm_size": args.gemm_size,
        "gemm_reps": 3 if args.quick else 9,
        "seed": args.seed,
        "threads": args.threads,
    }


# The results: runs aggregated per system, ratios, greedy agreement, the JSON report.
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
        "machine": {
            **rp.machine(),
            "torch": rp.package_version("torch"),
            "transformers": rp.package_version("transformers"),
        },
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


# The markdown report.
def _header_lines(report: dict) -> list[str]:
    out: list[str] = []
    tr, wl = report["trace"], report["workload"]
    out.append("")
    out.append(
        f"## iterserve engine throughput ({'quick' if report['quick'] else 'full'} run, "
        f"{report['runs']} run(s), SmolLM2-135M-Instruct fp32, "
        f"{report['machine']['cpu_count']} CPUs)"
    )
    out.append("")
    out.append(f"Workload: {tr['attribution']}.")
    out.append(
        f"Window: {tr['window']}. Prompt len = {tr['prompt_len']}; output len = "
        f"{tr['output_len']}; prompt ids {tr['prompt_token_ids']}."
    )
    out.append(
        f"{wl['num_requests']} requests, {wl['prompt_tokens_total']} prompt tokens "
        f"(p50 {wl['prompt_len_p50']}, max {wl['prompt_len_max']}), "
        f"{wl['output_tokens_total']} output tokens (p50 {wl['output_len_p50']}, "
        f"max {wl['output_len_max']})."
    )
    out.append("")
    return out


def _system_notes(s: dict) -> str:
    notes = []
    if s["errors"]:
        notes.append(f"ERROR: {s['errors'][0][:160]}")
    if "output_tokens_computed" in s:
        notes.append(
            f"computed {s['output_tokens_computed'][0]} output tokens for "
            f"{s.get('output_tokens')} useful"
        )
    if "preemptions" in s and any(s["preemptions"]):
        notes.append(f"preemptions {s['preemptions']}")
    if "ttft_s_p50" in s:
        notes.append(f"TTFT p50 {fmt(median(s['ttft_s_p50']), '.2f')} s")
    return "; ".join(notes)


def _systems_lines(report: dict) -> list[str]:
    out: list[str] = []
    out.append(
        "| system | output tok/s (median) | output tok/s per run | total tok/s | wall s "
        "| peak RSS MiB | own cores used | other load (cores) per run | notes |"
    )
    out.append("|---|---:|---|---:|---:|---:|---|---|---|")
    for name, s in report["systems"].items():
        per = ", ".join(fmt(x, ".1f") for x in s["output_tok_s_runs"])
        out.append(
            f"| {name} | {fmt(s['output_tok_s_median'], '.1f')} | {per} | "
            f"{fmt(s['total_tok_s_median'], '.1f')} | {fmt(s['wall_s_median'], '.1f')} | "
            f"{fmt(s['peak_rss_mib_max'], '.0f')} | "
            f"{', '.join(fmt(x, '.2f') for x in s['own_cores_runs'])} | "
            f"{', '.join(fmt(x, '.2f') for x in s['foreign_cores_runs'])} | "
            f"{_system_notes(s)} |"
        )
    out.append("")
    out.append(
        "Peak RSS: ru_maxrss of each system's own subprocess (weights + KV cache + "
        "activations), max over runs. Own cores: the worker's CPU seconds / wall in the timed "
        "section (how parallel it really ran). Other load: average cores other processes "
        "kept busy "
        "during the timed section (/proc/stat minus this worker); well above 0 means the "
        f"numbers are contended. torch threads per worker: {report['machine']['torch_threads']}."
    )
    out.append("")
    return out


def _at64(report: dict) -> dict | None:
    """The decode sweep's point at 64 sequences, if it ran."""
    sw = report.get("decode_sweep") or {}
    return next((p for p in sw.get("points", []) if p["num_seqs"] == 64), None)


def targets_table(report: dict) -> list[str]:
    """The ratios against transformers and the decode sweep's targets at 64 sequences, as a
    markdown table (no lines when the run measured none of them)."""
    at64 = _at64(report)
    lines = []
    if report["ratios"] or at64:
        lines += ["| metric | measured | per run | target | met |", "|---|---:|---|---:|---|"]
    for key, r in report["ratios"].items():
        per = ", ".join(fmt(x, ".2f") for x in r["per_run"])
        target = "—" if r["target"] is None else f"≥{r['target']}x"
        lines.append(
            f"| {key.replace('_', ' ')} | {fmt(r['median'], '.2f')}x | {per} | "
            f"{target} | {fmt(r['met'], '')} |"
        )
    if at64:
        pct, sp = at64["pct_roofline"], at64["sched_prep_pct"]
        lines.append(
            f"| decode % of roofline at 64 seqs | {pct:.1f}% | | "
            f"≥{TARGETS['decode_pct_roofline_at_64']:.0f}% | "
            f"{pct >= TARGETS['decode_pct_roofline_at_64']} |"
        )
        lines.append(
            f"| scheduling+prep % of step at 64 seqs | {sp:.1f}% | | "
            f"≤{TARGETS['sched_prep_pct_at_64']:.0f}% | "
            f"{sp <= TARGETS['sched_prep_pct_at_64']} |"
        )
    return lines


def _sweep_row(p: dict, plain: dict) -> str:
    b = p["breakdown_ms"]
    q = plain.get(p["num_seqs"])
    vs = "—" if q is None else f"{q['tok_s']:.1f} ({p['tok_s'] / q['tok_s']:.2f}x)"
    return (
        f"| {p['num_seqs']} | {p['tok_s']:.1f} | {p['pct_roofline']:.1f} | "
        f"{p['step_ms_mean']:.1f} | {b['schedule']:.2f} | {b['prepare']:.2f} | "
        f"{b['forward']:.1f} | {b['sample']:.2f} | {b['other']:.2f} | "
        f"{p['sched_prep_pct']:.1f} | {p['outside_forward_pct']:.1f} | "
        f"{fmt(p['foreign_cores'], '.2f')} | {vs} |"
    )


def _sweep_lines(report: dict, sw: dict) -> list[str]:
    out: list[str] = []
    if sw.get("error"):
        out.append(f"Decode sweep ERROR: {sw['error']}")
        return out
    if not sw:
        return out
    g = sw["gemm"]
    out.append(
        f"Decode sweep (iterserve, {sw['prompt_len']}-token prompts, pure-decode steps "
        f"only). Roofline: fp32 GEMM {g['gflop_s']:.1f} GFLOP/s (torch.mm {g['n']}x{g['n']}, "
        f"median of {g['reps']}) / (2 x {sw['num_params'] / 1e6:.1f} M params) = "
        f"{sw['roofline_tok_s']:.0f} tok/s."
    )
    out.append("")
    plain = {
        p["num_seqs"]: p for p in (report.get("decode_sweep_noprepack") or {}).get("points", [])
    }
    out.append(
        "| seqs | decode tok/s | % roofline | step ms (mean) | schedule ms | prepare ms "
        "| forward ms | sample ms | other ms | sched+prep % | outside forward % "
        "| other load (cores) | tok/s without prepack (ratio) |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in sw["points"]:
        out.append(_sweep_row(p, plain))
    out.append("")
    return out


def _agreement_lines(report: dict) -> list[str]:
    out: list[str] = []
    ag = report.get("greedy_agreement") or {}
    if not ag:
        return out
    out.append("Greedy agreement (run 1 tokens; fp32, different batch shapes may flip near-ties):")
    out.append("")
    out.append("| pair | identical requests | first divergence positions |")
    out.append("|---|---:|---|")
    for pair, a in ag.items():
        pos = a["first_divergence_positions"]
        shown = ", ".join(map(str, pos[:12])) + (" ..." if len(pos) > 12 else "")
        out.append(f"| {pair} | {a['identical']}/{a['requests']} | {shown or '—'} |")
    out.append("")
    return out


def markdown(report: dict) -> str:
    """The whole report as markdown."""
    sw = report.get("decode_sweep") or {}
    return "\n".join(
        _header_lines(report)
        + _systems_lines(report)
        + targets_table(report)
        + [""]
        + _sweep_lines(report, sw)
        + _agreement_lines(report)
    )


# The command line, the runs, the sweeps.
DEFAULT_OUT = RESULTS / "engine_throughput.json"
QUICK_OUT = RESULTS / "engine_throughput_quick.json"
SYSTEMS = ("iterserve", "iterserve_noprepack", "hf_generate", "hf_generate_batch")


def parse_args(argv=None) -> argparse.Namespace:
    ap = cli.parser("bench.engine_throughput", __doc__)
    cli.add_quick(ap, "tiny smoke run: 8 requests, 1 run, short sweep (about 1-2 min)")
    ap.add_argument("--runs", type=int, default=None, help="runs per system (default 3; quick 1)")
    ap.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="trace rows in the window (default 64; quick 8)",
    )
    cli.add_window_start(ap, 0)
    ap.add_argument(
        "--prompt-scale",
        type=float,
        default=16.0,
        help="prompt length = round(ContextTokens / this)",
    )
    ap.add_argument(
        "--output-scale",
        type=float,
        default=8.0,
        help="output length = round(GeneratedTokens / this)",
    )
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=64)
    cli.add_seed(ap)
    cli.add_trace(ap, Path)
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of hf_generate")
    ap.add_argument(
        "--hf-cb-api",
        choices=("manager", "generate_batch"),
        default="manager",
        help="manager: per-request max_new_tokens through generate_batch's manager; "
        "generate_batch: the call itself, one max_new_tokens for all",
    )
    ap.add_argument("--no-sweep", action="store_true", help="skip the decode sweep")
    ap.add_argument("--sweep-sizes", default="1,8,32,64")
    ap.add_argument(
        "--sweep-steps",
        type=int,
        default=None,
        help="measured pure-decode steps per size (default 20; quick 4)",
    )
    ap.add_argument("--gemm-size", type=int, default=2048)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads in every worker (default: torch's default, "
        "one per core); 1 is far less hurt by other processes on a busy machine",
    )
    ap.add_argument("--worker-timeout", type=float, default=1800.0)
    cli.add_out(
        ap,
        None,
        f"JSON path (default {os.path.relpath(DEFAULT_OUT, REPO)}, "
        f"or {os.path.relpath(QUICK_OUT, REPO)} with --quick)",
        type=Path,
    )
    args = ap.parse_args(argv)
    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 64
    if args.sweep_steps is None:
        args.sweep_steps = 4 if args.quick else 20
    if args.out is None:
        args.out = QUICK_OUT if args.quick else DEFAULT_OUT
    return args


# --------------------------------------------------------------------------------------------
# The run, phase by phase
# --------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> tuple[list[str], dict, dict, dict]:
    """The systems to run, the workload, its stats and every system's config; checks that the
    longest request fits the KV cache."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {sorted(unknown)}")
    wl = build_workload(args)
    stats = workload_stats(wl)
    kv_tokens = args.num_kv_blocks * args.block_size
    longest = max(len(p) + n for p, n in zip(wl["prompts"], wl["output_lens"]))
    if longest > kv_tokens:
        raise SystemExit(f"a request needs {longest} tokens; the KV cache holds {kv_tokens}")
    configs = system_configs(args)
    for c in configs.values():
        c["threads"] = args.threads
    print(
        f"workload: {stats['num_requests']} requests, {stats['prompt_tokens_total']} prompt + "
        f"{stats['output_tokens_total']} output tokens; {args.runs} run(s) of "
        f"{', '.join(systems)}",
        flush=True,
    )
    return systems, wl, stats, configs


def run_systems(
    args: argparse.Namespace, systems: list[str], workload: dict, configs: dict
) -> dict[str, list[dict]]:
    """Every system's runs, interleaved: run 1 of each system, then run 2, ..."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for i in range(args.runs):
        for name in systems:
            t = time.perf_counter()
            r = spawn(name, workload, configs[name], args.worker_timeout)
            runs[name].append(r)
            what = (
                f"ERROR {r['error']}"
                if "error" in r
                else f"{r['output_tok_s']:.1f} out tok/s, wall {r['wall_s']:.1f} s, "
                f"peak RSS {r['peak_rss_mib']:.0f} MiB, other load "
                f"{fmt(r.get('foreign_cores'), '.2f')} cores"
            )
            print(
                f"[run {i + 1}/{args.runs}] {name}: {what} "
                f"({time.perf_counter() - t:.0f} s with start-up)",
                flush=True,
            )
    return runs


def _sweep(label: str, cfg: dict, timeout: float) -> dict:
    t = time.perf_counter()
    res = spawn("sweep", {}, cfg, timeout)
    what = f"ERROR {res['error']}" if "error" in res else "done"
    print(f"{label}: {what} ({time.perf_counter() - t:.0f} s)", flush=True)
    return res


def run_sweeps(args: argparse.Namespace, configs: dict) -> tuple[dict | None, dict | None]:
    """The decode sweep with weight prepacking and without; (None, None) with --no-sweep."""
    if args.no_sweep:
        return None, None
    cfg = sweep_config(args, configs["iterserve"])
    sweep = _sweep("decode sweep", cfg, args.worker_timeout)
    plain = _sweep(
        "decode sweep without weight prepacking",
        {**cfg, "cpu_weight_prepack": False},
        args.worker_timeout,
    )
    return sweep, plain


def finish(args: argparse.Namespace, report: dict, busy: bool) -> None:
    """Write the JSON; print the report, the contention warning and the failures."""
    rp.write_report(args.out, report, markdown(report), md_file=False)
    if busy:
        print(f"WARNING: {report['contention_warning']}\n")
    for name, s in report["systems"].items():
        if s["errors"]:
            print(f"{name} failed: {s['errors'][0]}\n{s.get('stderr_tail', '')[-1500:]}")
    print(f"{report['elapsed_s']:.0f} s in all")


EXPECTED_S = {"round": 200.0, "sweeps": 150.0, "quick": 240.0}
"""Seconds for the expected duration printed first, on a 2-core host: one round of the four
systems at the default workload, the two decode sweeps, and a whole ``--quick`` run (the
committed full run's elapsed time in ``bench/results/engine_throughput.json`` is three rounds
and the sweeps)."""


def expected_s(args: argparse.Namespace) -> float:
    """Rough wall time of the run ``args`` asks for (:data:`EXPECTED_S`)."""
    if args.quick:
        return EXPECTED_S["quick"]
    runs = args.runs if args.runs is not None else 3
    return runs * EXPECTED_S["round"] + (0.0 if args.no_sweep else EXPECTED_S["sweeps"])


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.expected("engine_throughput", expected_s(args))
    systems, wl, stats, configs = prepare(args)
    workload = {"prompts": wl["prompts"], "output_lens": wl["output_lens"]}
    t_start = time.perf_counter()
    runs = run_systems(args, systems, workload, configs)
    sweeps = run_sweeps(args, configs)
    greedy = greedy_agreement(runs, systems)
    report = assemble(args, wl, stats, configs, runs, sweeps, greedy, t_start)
    busy = contention(report, sweeps[0])
    finish(args, report, busy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
