"""Scheduling benchmark, chunk experiment: a long prompt arrives while requests decode.

``--decoders`` interactive requests (prompts of the window's first rows) reach steady
decoding; then a ``--long-prompt``-token prompt (max_tokens 1) arrives, ``--long-repeats``
times, 10 decode tokens apart. Measured per variant (chunking off, or a chunk budget): the
decoders' inter-token gaps while the long prompt prefills (arrival to first token) against
steady gaps. The target's "TPOT of running decodes while a long prompt arrives" is each
decoder's mean gap over the prefill windows; its p99 over decoders is compared with the
steady TPOT (the mean gap with no prefill in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from typing import Any

import loadgen
import report as rp
from cpu_load import cpu_snapshot, foreign_cores
from inprocess import start_engine, stop_engine, wait_idle
from loadgen import LoadRequest
from sched_sweep import engine_config
from workload import Window, token_ids

STEADY_TOKENS = 14  # decode tokens before the first long prompt


def variants(args: argparse.Namespace) -> list[tuple[str, bool, int]]:
    """(name, chunked, budget) per ``--chunk-variants`` entry ('off' or a budget)."""
    out = []
    for v in (v.strip() for v in args.chunk_variants.split(",")):
        if v == "off":
            out.append(("no-chunk", False, max(args.nochunk_budget, args.long_prompt)))
        elif v:
            out.append((f"chunk-{int(v)}", True, int(v)))
    return out


async def _wait_tokens(recs: list[dict], target: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while min(r["output_tokens"] for r in recs) < target and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _drive(
    target, decoders: list[LoadRequest], longs: list[LoadRequest]
) -> tuple[list[dict], list[tuple[float, float]], float]:
    """Run the decoders, send each long prompt once they are steady; the decoders'
    records, the long prompts' prefill windows (s from t0) and t0."""
    t0 = time.perf_counter()
    recs = [loadgen.new_record(r) for r in decoders]
    tasks = [
        asyncio.create_task(loadgen.send(target, r, rec, t0)) for r, rec in zip(decoders, recs)
    ]
    windows = []
    try:
        goal = STEADY_TOKENS
        for lp in longs:
            await _wait_tokens(recs, goal)
            lp.arrival_s = time.perf_counter() - t0
            lrec = loadgen.new_record(lp)
            await loadgen.send(target, lp, lrec, t0)
            windows.append((lp.arrival_s, lrec["first_token_s"] or lrec["end_s"]))
            goal = min(r["output_tokens"] for r in recs) + 10
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return recs, windows, t0


def _gaps(recs: list[dict], windows: list[tuple[float, float]]) -> dict[str, Any]:
    during, steady, per_dec = [], [], []
    for rec in recs:
        ts, mine = rec["token_s"], []
        for a, b in zip(ts[1:], ts[2:]):  # skip the first gap (ramp-up)
            if any(a < w1 and b > w0 for w0, w1 in windows):
                during.append(b - a)
                mine.append(b - a)
            elif all(b <= w0 or a >= w1 + 0.05 for w0, w1 in windows):
                steady.append(b - a)
        if mine:
            per_dec.append(statistics.fmean(mine))
    steady_tpot = statistics.fmean(steady) if steady else None
    tpot_p99 = rp.percentile(per_dec, 99)
    itl_p50, itl_p99 = rp.percentile(steady, 50), rp.percentile(during, 99)
    return {
        "steady_itl_p50_s": itl_p50,
        "steady_itl_p99_s": rp.percentile(steady, 99),
        "during_itl_p50_s": rp.percentile(during, 50),
        "during_itl_p99_s": itl_p99,
        "during_itl_max_s": max(during, default=None),
        "during_gaps": len(during),
        "steady_tpot_s": steady_tpot,
        "during_tpot_s": per_dec,
        "during_tpot_p99_s": tpot_p99,
        "tpot_p99_over_steady": tpot_p99 / steady_tpot if tpot_p99 and steady_tpot else None,
        "p99_over_steady": itl_p99 / itl_p50 if itl_p99 and itl_p50 else None,
    }


async def run_variant(
    args: argparse.Namespace,
    decoders: list[LoadRequest],
    longs: list[LoadRequest],
    chunked: bool,
    budget: int,
) -> dict[str, Any]:
    config = engine_config(args, "fcfs", chunked, False, budget)
    target, _ = await start_engine(config)
    cpu0, t_start = cpu_snapshot(), time.monotonic()
    err = None
    try:
        recs, windows, _ = await _drive(target, decoders, longs)
    except Exception as e:  # noqa: BLE001 - a failed variant is reported, the rest run
        err, recs, windows = repr(e), [], []
    foreign = foreign_cores(cpu0, cpu_snapshot(), time.monotonic() - t_start)
    idle = await wait_idle(target)
    await stop_engine(target)
    return {
        "engine": config,
        "long_prefill_s": [b - a for a, b in windows],
        **_gaps(recs, windows),
        "decoder_tpot_s": [
            (r["last_token_s"] - r["first_token_s"]) / (r["output_tokens"] - 1)
            if r["status"] == "finished" and r["output_tokens"] > 1
            else None
            for r in recs
        ],
        "timeline": [[round(t, 3) for t in r["token_s"]] for r in recs],
        "windows": [[round(a, 3), round(b, 3)] for a, b in windows],
        "foreign_cores": foreign,
        "error": err,
        "blocks_ok": idle["blocks_ok"],
        "engine_error": idle["engine_error"],
    }


async def exp_chunk(wl: Window, args: argparse.Namespace) -> dict[str, Any]:
    vs = variants(args)
    k = args.decoders
    min_budget = min([b for _, c, b in vs if c] or [args.long_prompt])
    stall_steps = math.ceil(args.long_prompt / max(1, min_budget - k))
    max_tokens = STEADY_TOKENS + (stall_steps + 12) * args.long_repeats + 4
    out: dict[str, Any] = {
        "long_prompt_tokens": args.long_prompt,
        "decoders": k,
        "decoder_max_tokens": max_tokens,
        "repeats": args.long_repeats,
        "variants": {},
    }
    for name, chunked, budget in vs:
        decoders = [wl.request(i, f"dec-{name}", cls="interactive") for i in range(k)]
        for d in decoders:
            d.max_tokens = max_tokens
        longs = [
            LoadRequest(
                f"long-{name}-{j}",
                -1,
                "interactive",
                token_ids(args.seed + 7, j, args.long_prompt),
                args.long_prompt,
                1,
            )
            for j in range(args.long_repeats)
        ]
        out["decoder_prompt_lens"] = [d.prompt_tokens for d in decoders]
        res = out["variants"][name] = await run_variant(args, decoders, longs, chunked, budget)
        print(
            f"[chunk] {name}: TPOT during long prefill p99 "
            f"{rp.fmt(res['during_tpot_p99_s'], '.3f')} s vs steady "
            f"{rp.fmt(res['steady_tpot_s'], '.3f')} s = "
            f"{rp.fmt(res['tpot_p99_over_steady'])}x; ITL p99/p50 "
            f"{rp.fmt(res['p99_over_steady'])}x; prefill "
            f"{', '.join(f'{x:.2f}' for x in res['long_prefill_s'])} s; other load "
            f"{rp.fmt(res['foreign_cores'])}" + (f" ERROR {res['error']}" if res["error"] else ""),
            flush=True,
        )
    return out
