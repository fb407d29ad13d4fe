"""The scheduling suite's experiments (:mod:`bench.scheduling`): ``chunk`` (a long prompt
arriving while requests decode), ``admission`` (on against off, from the sweep) and
``priority`` (interactive requests beside saturating batch traffic)."""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from typing import Any

from bench.scheduling.sweep import engine_config, slo_of
from bench.toolkit import loadgen
from bench.toolkit import report as rp
from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores
from bench.toolkit.inprocess import run_open, start_engine, stop_engine, wait_idle
from bench.toolkit.loadgen import LoadRequest
from bench.toolkit.workload import Window, token_ids


def admission_experiment(sweep: dict) -> dict | None:
    """At the highest load: admitted interactive attainment and SLO goodput rate against
    the peak over loads, admission on against off."""
    pairs = []
    for on_name, off_name in (("cont-chunk+adm", "cont-chunk"), ("priority+adm", "priority")):
        if on_name not in sweep:
            continue
        on_pts = sweep[on_name]["points"]
        top = max(on_pts, key=lambda p: p["load_x"])
        peers = [on_pts] + ([sweep[off_name]["points"]] if off_name in sweep else [])
        peak = max(p["goodput_rate"] for pts in peers for p in pts)

        def view(p, peak=peak):
            s = p["summary"]
            i = s.get("per_class", {}).get("interactive", {})
            return {
                "load_x": p["load_x"],
                "rate": p["rate"],
                "admitted_interactive_attainment": i.get("attainment_admitted"),
                "attainment": s["attainment"],
                "refused": s["refused"],
                "goodput_rate": p["goodput_rate"],
                "goodput_frac_of_peak": p["goodput_rate"] / peak if peak else None,
            }

        match = [
            p for p in sweep.get(off_name, {}).get("points", []) if p["load_x"] == top["load_x"]
        ]
        pairs.append(
            {
                "on_config": on_name,
                "off_config": off_name,
                "load_x": top["load_x"],
                "peak_goodput_rate": peak,
                "on": view(top),
                "off": view(match[0]) if match else None,
            }
        )
    return {"pairs": pairs} if pairs else None


# The chunk experiment: a long prompt arrives while requests decode.
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


# The priority experiment: interactive requests beside saturating batch traffic.
PRIORITY_BATCH_MAX_WORK_SHARE = 0.10
"""At a larger interactive share the bar measures the share itself (at 18%, batch could
keep 82% at most); those loads are reported, with their ceiling, but not judged."""


async def one_run(args: argparse.Namespace, policy: str, reqs: list, tag: str) -> dict[str, Any]:
    """One open-loop run; batch tokens counted within the duration."""
    from policies import DEFAULT_CLASSES

    duration = args.priority_duration
    config = engine_config(args, policy, True, policy == "priority")
    target, _ = await start_engine(config)
    run, info = await run_open(
        target,
        reqs,
        cutoff_s=duration + args.drain,
        drain_only={"interactive"},
        arrivals_end_s=duration,
    )
    await stop_engine(target)
    in_window = sum(
        sum(1 for t in r["token_s"] if t <= duration) for r in run.records if r["class"] == "batch"
    )
    summ = rp.summarize(run.records, len(reqs) / duration, slo_of(DEFAULT_CLASSES), run.wall_s)
    per = summ.get("per_class", {})
    res = {
        "engine": config,
        "summary": summ,
        "batch_tok_s_in_window": in_window / duration,
        "interactive_ttft_s": [r["ttft_s"] for r in run.records if r["class"] == "interactive"],
        **info,
    }
    i = per.get("interactive")
    print(
        f"[priority] {tag}: batch {res['batch_tok_s_in_window']:.1f} tok/s in window"
        + (
            f"; interactive TTFT p50 {rp.fmt(i['ttft_s']['p50'])} p99 "
            f"{rp.fmt(i['ttft_s']['p99'])} s ({i['requests']} req, {i['cut_off']} cut off)"
            if i
            else ""
        )
        + f", preemptions {info['preemptions']}, other load {rp.fmt(info['foreign_cores'])}",
        flush=True,
    )
    return res


def _stream(
    wl: Window, args: argparse.Namespace, capacity: float, load: float, p_mean: float, o_mean: float
) -> tuple[list, dict[str, Any]]:
    reqs, _ = wl.at_rate(
        load * capacity,
        args.priority_duration,
        f"int-{load:g}",
        start=args.interactive_offset_rows,
        cls="interactive",
    )
    tok_s = sum(r.prompt_tokens + r.max_tokens for r in reqs) / args.priority_duration
    return reqs, {
        "load_x": load,
        "rate": load * capacity,
        "requests": len(reqs),
        "rows": [reqs[0].row, reqs[-1].row],
        "tok_s": tok_s,
        "work_share": tok_s / (capacity * (p_mean + o_mean)),
        "fcfs": None,
        "priority": [],
        "batch_frac": [],
        "alone": [],
    }


def _pool(s: dict[str, Any]) -> None:
    ttfts = [t for r in s["priority"] for t in r["interactive_ttft_s"] if t is not None]
    s["ttft_p99_pooled_s"] = rp.percentile(ttfts, 99)
    s["alone_ttft_p99_pooled_s"] = rp.percentile(
        [t for r in s["alone"] for t in r["interactive_ttft_s"] if t is not None], 99
    )
    s["ttft_samples"] = len(ttfts)
    s["censored"] = sum(
        r["summary"]["per_class"]["interactive"]["ttft_censored"] for r in s["priority"]
    )
    s["batch_frac_median"] = statistics.median(s["batch_frac"]) if s["batch_frac"] else None


async def exp_priority(wl: Window, args: argparse.Namespace, capacity: float) -> dict[str, Any]:
    duration = args.priority_duration
    batch, _ = wl.at_rate(args.batch_load * capacity, duration, "batch", cls="batch")
    p_mean, o_mean = wl.mean_lengths(args.capacity_rows)
    out: dict[str, Any] = {
        "scaling": wl.lengths.describe(),
        "duration_s": duration,
        "repeats": args.priority_repeats,
        "batch_rate": args.batch_load * capacity,
        "batch_requests": len(batch),
        "batch_rows": [batch[0].row, batch[-1].row],
        "batch_alone": [],
        "interactive": {},
    }
    streams = {}
    for load in args.interactive_loads:
        streams[load], out["interactive"][f"{load:g}"] = _stream(
            wl, args, capacity, load, p_mean, o_mean
        )

    def mixed(load):
        return sorted(batch + streams[load], key=lambda r: r.arrival_s)

    for load, reqs in streams.items():
        st = out["interactive"][f"{load:g}"]
        st["fcfs"] = await one_run(args, "fcfs", mixed(load), f"mixed-fcfs@{load:g}x")
        st["alone"].append(await one_run(args, "priority", reqs, f"interactive-alone@{load:g}x"))
    runs = []
    for rep in range(args.priority_repeats):
        out["batch_alone"].append(await one_run(args, "priority", batch, f"batch-alone#{rep}"))
        for load in streams:
            r = await one_run(args, "priority", mixed(load), f"mixed-priority@{load:g}x#{rep}")
            out["interactive"][f"{load:g}"]["priority"].append(r)
            runs.append((rep, load, r))
    if args.priority_repeats:
        out["batch_alone"].append(
            await one_run(args, "priority", batch, f"batch-alone#{args.priority_repeats}")
        )
    for rep, load, r in runs:
        before, after = (out["batch_alone"][rep + k]["batch_tok_s_in_window"] for k in (0, 1))
        if before and after:
            out["interactive"][f"{load:g}"]["batch_frac"].append(
                r["batch_tok_s_in_window"] / ((before + after) / 2)
            )
    for s in out["interactive"].values():
        _pool(s)
    return out
