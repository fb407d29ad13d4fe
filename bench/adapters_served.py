"""Served goodput with requests spread over LoRA adapters, against the same requests on
the base model alone, on one ``iterserve serve`` in one run.

Run from the repository root::

    python -m bench.adapters_served [--quick] [--adapters 8] [--rates 2,3,4,5,6,7,8]

Setup
    One ``iterserve serve`` (its defaults: the embedded GGUF's packed weights, the priority
    policy, the TPOT guard, admission) with ``--adapters`` random rank-16 PEFT adapters on
    all seven projections (:func:`bench.adapters.make_adapters`) in its ``lora_adapters``,
    ``max_loras`` and ``max_cpu_loras`` both that count (every adapter fits a step and
    host memory, as a deployment sized for its adapters would set them).

Workload
    The trace window of :mod:`bench.toolkit.serve_bench` (Azure LLM inference trace 2023,
    conversation; its lengths, arrivals rescaled per offered rate, open loop, greedy,
    ``ignore_eos``), judged by the suite's SLOs (``bench.peers``': TTFT <= 2 s, TPOT <=
    0.25 s). Mode ``base`` sends every request to the base model; mode ``adapters`` sends
    the same requests (lengths, arrivals) with request ``i`` of the window naming adapter
    ``i mod N``.

Pairs
    At each rate the two modes run back to back, in alternating order from rate to rate,
    so that the host's drift falls on both; each mode's prompts differ from the other's
    (the prefix cache cannot carry over). Goodput is the highest offered rate whose
    attainment reaches 90% (:func:`bench.toolkit.report.goodput`); the table gives both
    modes' attainment at every rate, the spread of a pair is the difference between them.

Output
    ``bench/results/adapters_served.json`` (every request's record) and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.toolkit import RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit import serve_bench as sb
from bench.toolkit import servers as ps

MODES = ("base", "adapters")
RANK_NOTE = "rank 16 on q, k, v, o, gate, up and down"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser("bench.adapters_served", __doc__)
    cli.add_quick(p, "2 adapters, 8 requests at one rate")
    cli.add_trace(p)
    cli.add_slos(p, 2.0, 0.25)
    cli.add_seed(p)
    cli.add_out(p, RESULTS / "adapters_served.json", "the result (JSON; markdown beside it)")
    p.add_argument("--adapters", type=int, default=8, help="adapters the requests spread over")
    p.add_argument("--rates", type=cli.floats, default="2,3,4,5,6,7,8", help="offered req/s")
    p.add_argument("--num-requests", type=int, default=50, help="requests per rate and mode")
    p.add_argument("--window-start", type=int, default=1000, help="the trace's first row")
    p.add_argument("--length-scale", type=float, default=8.0)
    p.add_argument("--max-rate-s", type=float, default=120.0, help="cap per rate and mode (s)")
    args = p.parse_args(argv)
    if args.quick:
        args.adapters, args.rates, args.num_requests = 2, [1.0], 8
    return args


def expected_s(args: argparse.Namespace) -> float:
    per_mode = sum(min(args.num_requests / r + 8, args.max_rate_s) for r in args.rates)
    return 60 + len(MODES) * per_mode


def spread(workload: list, names: list[str]) -> list:
    """``workload`` with request ``i`` naming adapter ``names[i % len(names)]``."""
    return [replace(req, model=names[i % len(names)]) for i, req in enumerate(workload)]


async def replay(args: argparse.Namespace, server: ps.Server, names: list[str]) -> dict:
    cfg = sb.BenchConfig(
        base_url=server.url,
        model=server.model_name,
        tokenizer=server.model_dir,
        trace=args.trace,
        window_start=args.window_start,
        num_requests=args.num_requests,
        rates=args.rates,
        length_scale=args.length_scale,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        max_duration_s=args.max_rate_s,
        label="adapters",
        warmup=2,
        seed=args.seed,
    )
    summaries: dict[str, list[dict]] = {m: [] for m in MODES}
    records: list[dict] = []
    async with sb.http_client(cfg.timeout_s) as client:
        for i, rate in enumerate(args.rates):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for j, mode in enumerate(order):
                workload = sb.build_workload(cfg, rate, replay=2 * i + j)
                if mode == "adapters":
                    workload = spread(workload, names)
                print(f"[adapters_served] rate {rate:g} req/s, {mode}", flush=True)
                result = await sb.run_rate(cfg, workload, rate, client)
                result["summary"]["mode"] = mode
                summaries[mode].append(result["summary"])
                records += [{**r, "mode": mode} for r in result["records"]]
                await asyncio.sleep(cfg.cooldown_s)
    return {
        "summaries": summaries,
        "goodput": {m: rp.goodput(s) for m, s in summaries.items()},
        "records": records,
    }


def markdown(result: dict) -> str:
    lines = [
        "# Served goodput: requests over LoRA adapters against the base model",
        "",
        f"`{result['run']['command']}` on {result['run']['host']} at "
        f"{result['run']['date']} (commit {result['run']['commit']}).",
        "",
    ]
    return "\n".join(lines + table(result)) + "\n"


def table(result: dict) -> list[str]:
    """The setup in one paragraph, attainment per rate and mode, and goodput per mode."""
    a = result["args"]
    lines = [
        f"One `iterserve serve` (defaults; packed GGUF weights) with {a['adapters']} adapters "
        f"({RANK_NOTE}; max_loras = max_cpu_loras = {a['adapters']}). The same "
        f"{a['num_requests']} requests per rate (trace rows {a['window_start']}+, open "
        f"loop), all on the base model or spread over the adapters, the two modes back to "
        f"back at each rate in alternating order. SLOs: TTFT <= {a['slo_ttft_s']:g} s, "
        f"TPOT <= {a['slo_tpot_s']:g} s; goodput: the highest rate with attainment >= 90%.",
        "",
        "| rate (req/s) | base attainment | adapters attainment | pair difference | "
        "base TTFT p50 (s) | adapters TTFT p50 (s) | base TPOT p50 (s) | adapters TPOT p50 (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base, lora = (result["summaries"][m] for m in MODES)
    for b, x in zip(base, lora):
        lines.append(
            f"| {b['rate']:g} | {b['attainment']:.0%} | {x['attainment']:.0%} | "
            f"{x['attainment'] - b['attainment']:+.0%} | {_p50(b, 'ttft')} | {_p50(x, 'ttft')} | "
            f"{_p50(b, 'tpot')} | {_p50(x, 'tpot')} |"
        )
    g = result["goodput"]
    lines += ["", "| mode | goodput (req/s) | interpolated | bound |", "|---|---:|---:|---|"]
    for m in MODES:
        lines.append(
            f"| {m} | {_num(g[m]['rps'])} | {_num(g[m]['interpolated'])} | {g[m]['bound']} |"
        )
    return lines


def _p50(summary: dict, metric: str) -> str:
    value = (summary.get(f"{metric}_s") or {}).get("p50")
    return "–" if value is None else f"{value:.3f}"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    from bench.adapters import make_adapters
    from engine.model.loader import resolve_model_dir

    args = parse_args(argv)
    cli.expected("adapters_served", expected_s(args), f"{len(args.rates)} rates x 2 modes")
    model_dir = resolve_model_dir(None)
    paths = make_adapters(model_dir, args.adapters, args.seed)
    names = [f"adapter-{i}" for i in range(len(paths))]
    n = len(names)
    spec = ps.SystemSpec(
        "iterserve",
        "iterserve",
        engine={"quantization": "auto", "max_loras": n, "max_cpu_loras": n},
        service={"lora_adapters": {name: str(p) for name, p in zip(names, paths)}},
    )
    t0 = time.monotonic()
    with ps.Server(spec, str(model_dir), mix=False, slo=(args.slo_ttft_s, args.slo_tpot_s)) as srv:
        result = asyncio.run(replay(args, srv, names))
    result = {"run": rp.run_record(), "args": {**vars(args), "trace": str(args.trace)}, **result}
    result["wall_s"] = time.monotonic() - t0
    rp.write_report(Path(args.out), result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
