"""Prefix caching and prefix-affinity routing over HTTP, beside vLLM's CPU build.

Run from the repository root::

    python -m bench.prefix_cache      # prints its expected duration first

Workload
    Multi-turn conversations: every request starts with one shared 500-token system prompt,
    and turn k re-sends the whole conversation so far (system prompt, then each earlier
    user message and answer) plus its new user message. Lengths come from the Azure LLM
    inference trace 2023 (conversation; Patel et al., ISCA 2024; CC-BY 4.0): conversation
    c's turns are rows ``window_start + c * turns ..``; a user message is
    clamp(round(ContextTokens / 8), 4, 256) tokens and an answer
    clamp(round(GeneratedTokens / 8), 1, 128), forced with ``max_tokens`` and
    ``ignore_eos``. Answers in the history are fixed token ids, not what the server
    generated, so every system sees the same prompts (a turn's cache hit therefore ends
    where the previous answer starts). Token ids are drawn from ordinary vocabulary.
    Open loop: conversations start at the trace's rescaled arrival times and each turn
    follows its conversation's previous one by ``--think-s`` seconds, whatever happened to it.

Systems (one at a time, same machine, same weights, same requests)
    iterserve with 2 replicas of 1 CPU: prefix caching off; on with the load-aware router;
    on with prefix-affinity routing (the default); and vLLM's CPU build (one server, as many
    OpenMP threads as cores) with its prefix caching on. ``--systems iterserve-one-replica``
    adds one replica of 2 CPUs.

Report
    Per system and rate, over the requests that finished: hit rate (cached prompt tokens /
    prompt tokens, from each response's ``usage.prompt_tokens_details.cached_tokens``) and
    prefill tokens computed; over all requests:
    TTFT p50/p99, SLO attainment; goodput (the highest rate with >= 90% attainment,
    :mod:`bench.toolkit.report`). JSON and the table go to ``bench/results/prefix_cache.*``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from bench.toolkit import RESULTS, cli, loadgen
from bench.toolkit import report as rp
from bench.toolkit import servers as ps
from bench.toolkit.loadgen import LoadRequest
from bench.toolkit.targets import HttpTarget, http_client
from bench.toolkit.workload import ATTRIBUTION, Lengths, arrival_offsets, read_trace, token_ids

SYSTEM_PROMPT_TOKENS = 500
LENGTHS = Lengths(max_prompt=256, max_output=128)
REPLICAS = {"num_replicas": 2, "replica_num_cpus": 1}
SYSTEMS = {
    "iterserve-cache-off": ps.SystemSpec(
        "iterserve-cache-off",
        "iterserve",
        {"enable_prefix_caching": False},
        {**REPLICAS, "prefix_affinity": False},
    ),
    "iterserve-load-aware": ps.SystemSpec(
        "iterserve-load-aware", "iterserve", {}, {**REPLICAS, "prefix_affinity": False}
    ),
    "iterserve-affinity": ps.SystemSpec("iterserve-affinity", "iterserve", {}, REPLICAS),
    # Not in the default run: one cache for every conversation (the hit-rate reference
    # for two replicas) and the host's two cores in one engine, as vLLM has them.
    "iterserve-one-replica": ps.SystemSpec(
        "iterserve-one-replica", "iterserve", {}, {"num_replicas": 1, "replica_num_cpus": 2}
    ),
    "vllm": ps.SystemSpec(
        "vllm", "vllm", args=("--enable-prefix-caching", "--enable-prompt-tokens-details")
    ),
}
START_S = 60.0
"""Seconds to start and stop one system (iterserve's Ray, vLLM's engine), for the estimate."""
DRAIN_S = 30.0


def conversations(args: argparse.Namespace, rate: float, replay: int) -> list[LoadRequest]:
    """Every turn of ``args.conversations`` conversations, offered at ``rate`` requests/s.

    Each ``replay`` (one per rate) has its own token ids, system prompt included, so that
    a later rate never finds an earlier rate's KV in the server's cache."""
    rows = read_trace(args.trace, args.window_start, args.conversations * args.turns + 1)
    starts = rows[:: args.turns][: args.conversations + 1]
    offsets, _ = arrival_offsets(starts, args.conversations, rate / args.turns)
    system = token_ids(args.seed, -1, SYSTEM_PROMPT_TOKENS, replay=2 * replay)
    out = []
    for c, start_s in enumerate(offsets):
        history = list(system)
        for k in range(args.turns):
            row = rows[c * args.turns + k]
            user = token_ids(args.seed, row.row, LENGTHS.prompt(row.context_tokens), 2 * replay)
            answer = LENGTHS.output(row.generated_tokens)
            prompt = history + user
            out.append(
                LoadRequest(
                    f"c{c}-t{k}",
                    row.row,
                    None,
                    prompt,
                    len(prompt),
                    answer,
                    start_s + k * args.think_s,
                )
            )
            history = prompt + token_ids(args.seed, row.row, answer, 2 * replay + 1)
    return sorted(out, key=lambda r: r.arrival_s)


def run_rate(args: argparse.Namespace, server: ps.Server, rate: float, replay: int) -> dict:
    workload = conversations(args, rate, replay)
    last = max(r.arrival_s for r in workload)

    async def go() -> loadgen.OpenLoopRun:
        async with http_client() as client:
            target = HttpTarget(client, server.url, server.model_name, class_header=None)
            warm = [
                LoadRequest(f"warm{i}", -1, None, token_ids(args.seed, -2 - i, 32), 32, 4)
                for i in range(2)
            ]
            await loadgen.open_loop(target, warm)
            return await loadgen.open_loop(target, workload, cutoff_s=last + DRAIN_S)

    run = asyncio.run(go())
    summary = rp.summarize(
        run.records, rate, lambda _: (args.slo_ttft_s, args.slo_tpot_s), run.wall_s
    )
    done = [r for r in run.records if r["status"] == "finished"]
    prompt = sum(r["prompt_tokens"] for r in done)
    cached = sum(r.get("cached_tokens") or 0 for r in done)
    summary.update(
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=cached / prompt if prompt else None,
        prefill_tokens_computed=prompt - cached,
        reported_cached=sum("cached_tokens" in r for r in done),
    )
    print(
        f"[prefix] {server.label} at {rate} req/s: attainment "
        f"{summary['attainment']:.0%}, hit rate {rp.pct(summary['hit_rate'])}, TTFT p50 "
        f"{rp.fmt(summary['ttft_s']['p50'])} s",
        flush=True,
    )
    summary["records"] = [rp.compact_record(r) for r in run.records]
    return summary


def run_system(args: argparse.Namespace, name: str, model_dir: str) -> dict:
    spec = SYSTEMS[name]
    with ps.Server(spec, model_dir, mix=False, slo=(args.slo_ttft_s, args.slo_tpot_s)) as server:
        rates = [run_rate(args, server, r, i) for i, r in enumerate(args.rates)]
    return {
        "label": spec.label,
        "command": server.command,
        "rates": rates,
        "goodput": rp.goodput(rates),
    }


def expected_s(args: argparse.Namespace) -> float:
    per_rate = sum(args.conversations * args.turns / r + DRAIN_S for r in args.rates)
    return len(args.systems) * (START_S + per_rate)


def table(report: dict) -> str:
    rows = []
    for name, res in report["systems"].items():
        for s in res["rates"]:
            rows.append(
                [
                    name,
                    f"{s['rate']:g}",
                    f"{s['ok']}/{s['requests']}",
                    rp.pct(s["hit_rate"]),
                    f"{s['prefill_tokens_computed']}",
                    rp.fmt(s["ttft_s"]["p50"]),
                    rp.fmt(s["ttft_s"]["p99"]),
                    rp.pct(s["attainment"]),
                    rp.fmt(res["goodput"]["rps"], ".2f", "none"),
                ]
            )
    return rp.table(
        [
            "system",
            "req/s",
            "finished",
            "hit rate",
            "prefill tokens computed",
            "TTFT p50 s",
            "TTFT p99 s",
            "SLO attainment",
            "goodput req/s",
        ],
        rows,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser("bench.prefix_cache", __doc__)
    p.add_argument(
        "--systems",
        type=cli.names,
        default=[s for s in SYSTEMS if s != "iterserve-one-replica"],
        help=f"comma-separated, of {', '.join(SYSTEMS)}",
    )
    p.add_argument(
        "--rates",
        type=cli.floats,
        default=[1.0, 2.0, 3.0],
        help="requests/s (all turns), comma-separated",
    )
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument(
        "--think-s", type=float, default=6.0, help="seconds from one turn's arrival to the next's"
    )
    cli.add_slos(p, 2.0, 0.25)
    cli.add_trace(p)
    cli.add_window_start(p, 2000)
    cli.add_seed(p)
    cli.add_out(p, str(RESULTS / "prefix_cache"), "stem of the .json and .md")
    args = p.parse_args(argv)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {sorted(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cli.expected("prefix", expected_s(args))
    t0 = time.monotonic()
    model_dir = ps.model_dir()
    report = {
        "args": vars(args),
        "machine": ps.machine_info(),
        "model_dir": model_dir,
        "trace_attribution": ATTRIBUTION,
        "lengths": LENGTHS.describe(),
        "systems": {n: run_system(args, n, model_dir) for n in args.systems},
    }
    report["wall_s"] = time.monotonic() - t0
    rp.write_report(Path(args.out).with_suffix(".json"), report, table(report), compact=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
