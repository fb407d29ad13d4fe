"""One open-loop replay through the in-process engine with the server's engine settings, in
a few minutes: a quick look at how a scheduling setting does at one window and rate.

``make bench-peers`` answers the served-goodput question over HTTP beside vLLM, in about
half an hour a window. This answers a narrower one fast: with the HTTP layer left out, how does the
engine (``deploy.config.SERVER_ENGINE_DEFAULTS`` plus the benchmark's SLOs declared as the
class SLOs, plus ``--engine`` overrides) do on a window of the conversation trace (lengths
/ 8, as the peers benchmark scales them) at one offered rate? Optionally the 70%
interactive / 30% batch mix and the ingress's admission. A single run's attainment
varies between runs of one setting on a shared 2-core host by more than most settings
change it: compare settings in alternating pairs. Not a suite: a probe to run while tuning,
whose rows are for comparing settings, not committed. Run from the repository root::

    python -m bench.guard_probe --window-start 3000 --rate 1.9 \\
        --slo-ttft-s 2.1 --slo-tpot-s 0.263 --step-log /tmp/steps.jsonl

Prints one row (attainment, TTFT and TPOT p50 / p99, refusals, the steps' prefill chunk
and durations) and appends it as a JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from bench.sim_validate import MIX
from bench.toolkit import report as rp
from bench.toolkit.inprocess import run_open, start_engine, stop_engine
from bench.toolkit.workload import REPO, TRACE, Lengths, Window
from deploy.config import SERVER_ENGINE_DEFAULTS
from engine.core.step_log import StepLog

OUT = REPO / "bench" / "results" / "guard_probe.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window-start", type=int, default=3000)
    p.add_argument("--rate", type=float, default=1.9, help="offered req/s")
    p.add_argument("--duration", type=float, default=80.0, help="seconds of arrivals")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.25)
    p.add_argument(
        "--engine",
        type=json.loads,
        default={},
        help="EngineConfig overrides as JSON, e.g. '{\"tpot_slo_guard\": false}'",
    )
    p.add_argument("--mix", action="store_true", help="70%% interactive / 30%% batch")
    p.add_argument("--admission", action="store_true", help="the ingress's admission loop")
    p.add_argument("--step-log", type=Path, default=None, help="one JSON line per step")
    p.add_argument("--out", type=Path, default=OUT, help="JSON lines, appended")
    return p.parse_args(argv)


def engine_config(args: argparse.Namespace) -> dict:
    slo = {"ttft_slo_s": args.slo_ttft_s, "tpot_slo_s": args.slo_tpot_s}
    classes = {"standard": slo, **({"interactive": slo} if args.mix else {})}
    return {**SERVER_ENGINE_DEFAULTS, "traffic_classes": classes, **args.engine}


async def replay(args: argparse.Namespace, requests: list):
    target, _ = await start_engine(engine_config(args), args.step_log, admission=args.admission)
    try:
        return await run_open(target, requests, cutoff_s=args.duration + 90)
    finally:
        await stop_engine(target)


def summarize(args: argparse.Namespace, records: list[dict], wall_s: float) -> dict:
    """Attainment (refused and unfinished requests are misses) and latency of the
    SLO-bound requests: all of them, or the mix's interactive ones; the mix's batch output
    tokens per second of ``wall_s``."""
    for r in records:
        rp.judge(r, args.slo_ttft_s, args.slo_tpot_s)
    batch_tokens = sum(r["output_tokens"] for r in records if r["class"] == "batch")
    judged = [r for r in records if not args.mix or r["class"] == "interactive"]
    ttft = [r["ttft_s"] for r in judged if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in judged if r["tpot_s"] is not None]
    return {
        "requests": len(judged),
        "attainment": sum(r["slo_met"] for r in judged) / len(judged),
        "not_finished": sum(r["status"] != "finished" for r in judged),
        "ttft_p50_s": rp.percentile(ttft, 50),
        "ttft_p99_s": rp.percentile(ttft, 99),
        "tpot_p50_s": rp.percentile(tpot, 50),
        "tpot_p99_s": rp.percentile(tpot, 99),
        "batch_tok_s": batch_tokens / wall_s if args.mix else None,
    }


def step_summary(path: Path | None) -> dict:
    """Prefill steps, their mean chunk and duration, and decode-only steps' duration."""
    if path is None:
        return {}
    steps = StepLog.read(path).steps
    prefill = [s for s in steps if s.num_prefill_tokens > 0]
    decode = [s.seconds for s in steps if s.num_prefill_tokens == 0]
    return {
        "steps": len(steps),
        "prefill_steps": len(prefill),
        "mean_chunk": (
            sum(s.num_prefill_tokens for s in prefill) / len(prefill) if prefill else None
        ),
        "prefill_step_s": statistics.fmean(s.seconds for s in prefill) if prefill else None,
        "decode_step_s": statistics.fmean(decode) if decode else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"expected duration: about {(args.duration + 30) / 60:.0f} min", flush=True)
    window = Window(
        TRACE,
        args.window_start,
        round(args.rate * args.duration) + 50,
        Lengths(),
        MIX if args.mix else None,
        seed=0,
    )
    requests, _ = window.at_rate(
        args.rate, args.duration, "probe", cls=None if args.mix else "standard"
    )
    if args.step_log is not None:
        args.step_log.unlink(missing_ok=True)
    run, info = asyncio.run(replay(args, requests))
    row = {
        "window_start": args.window_start,
        "rate": args.rate,
        "engine": args.engine,
        "mix": args.mix,
        "admission": args.admission,
        **summarize(args, run.records, run.wall_s),
        **step_summary(args.step_log),
        "preemptions": info["preemptions"],
        "blocks_ok": info["blocks_ok"],
    }
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    with args.out.open("a") as f:
        f.write(json.dumps(rp.finite(row)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
