"""Offline throughput of iterserve against transformers' two batch APIs, plus a decode sweep.

Run from the repository root::

    .venv/bin/python bench/engine_throughput.py            # full run, 3 runs (~5-15 min here)
    .venv/bin/python bench/engine_throughput.py --quick    # tiny smoke run (~1-2 min)

Workload
    Request lengths come from the Azure LLM inference trace 2023, conversation service
    (``deploy/sim/traces/azure_llm_2023_conv.csv``, shipped with the package; columns
    TIMESTAMP, ContextTokens, GeneratedTokens; CC-BY 4.0, published with Splitwise, Patel et al.,
    ISCA 2024). The window is the first ``--num-requests`` rows (default 64, i.e. rows 0-63,
    about the first 32 s of the trace), starting at ``--window-start`` (default 0). Arrival times
    are ignored: every request is submitted at once (offline batch throughput). Lengths are scaled
    so that one run of all three systems takes about 2-3 minutes on a 2-core CPU:
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
    times come from the ``engine.StepRecord`` the engine's ``on_step`` hook receives: the whole
    step (``seconds``), ``scheduler.schedule()`` (``schedule_s``) and the runner's own
    prepare / forward / sample breakdown of its ``execute`` (``phases``, perf_counter in
    ``TorchModelRunner``); "other" is the rest of the step (updating requests, detokenizing,
    outputs). Scheduling + input preparation as a fraction of the step is reported, with a
    target at 64 sequences. The sweep runs twice, with and without weight prepacking
    (``decode_sweep_noprepack``). iterserve's preemption count is the scheduler's
    ``num_preemptions`` over the timed run.

Code
    This file holds the command line and the run itself: spawning the workers, interleaving
    the systems' runs, the sweeps. Its parts, by job: ``bench/throughput_workload.py`` (the
    workload and each system's config), ``bench/throughput_aggregate.py`` (aggregation, ratios,
    greedy agreement, the JSON report), ``bench/throughput_report.py`` (the markdown report).
    The per-system workers, each run in its own subprocess (this script with ``--worker NAME``),
    are in ``bench/offline_workers.py`` (iterserve, the decode sweep, the dispatch) and
    ``bench/offline_hf.py`` (transformers), measuring with ``bench/offline_measure.py``.

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
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from offline_workers import WORKERS, worker_main
from report import fmt
from throughput_aggregate import assemble, contention, greedy_agreement
from throughput_report import print_report
from throughput_workload import build_workload, sweep_config, system_configs, workload_stats
from workload import REPO, TRACE

DEFAULT_OUT = REPO / "bench" / "results" / "engine_throughput.json"
QUICK_OUT = REPO / "bench" / "results" / "engine_throughput_quick.json"
SYSTEMS = ("iterserve", "iterserve_noprepack", "hf_generate", "hf_generate_batch")


def spawn(name: str, workload: dict, config: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="iterserve-bench-") as tmp:
        spec, result = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec.write_text(json.dumps({"workload": workload, "config": config}))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            name,
            "--spec",
            str(spec),
            "--result",
            str(result),
        ]
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if result.is_file():
            res = json.loads(result.read_text())
        else:
            res = {"error": f"worker exited with {proc.returncode} and no result"}
        if "error" in res:
            res["stderr_tail"] = proc.stderr[-3000:]
        return res


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: 8 requests, 1 run, short sweep (about 1-2 min)",
    )
    ap.add_argument("--runs", type=int, default=None, help="runs per system (default 3; quick 1)")
    ap.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="trace rows in the window (default 64; quick 8)",
    )
    ap.add_argument("--window-start", type=int, default=0, help="first trace row of the window")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=TRACE)
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
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON path (default {os.path.relpath(DEFAULT_OUT, REPO)}, "
        f"or {os.path.relpath(QUICK_OUT, REPO)} with --quick)",
    )
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
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
    """Print the report, the contention warning and the failures; write the JSON."""
    print_report(report)
    if busy:
        print(f"WARNING: {report['contention_warning']}\n")
    for name, s in report["systems"].items():
        if s["errors"]:
            print(f"{name} failed: {s['errors'][0]}\n{s.get('stderr_tail', '')[-1500:]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s in all)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.spec, args.result)
        return 0
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
