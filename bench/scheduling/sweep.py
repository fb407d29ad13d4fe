"""The scheduling suite's configs and load sweep: capacity, each config over loads x
capacity, goodput brackets (:mod:`bench.scheduling`)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.toolkit import loadgen
from bench.toolkit import report as rp
from bench.toolkit.inprocess import run_open, start_engine, stop_engine, wait_idle
from bench.toolkit.workload import Window

CONFIGS: dict[str, dict[str, Any]] = {
    "static": {
        "policy": "static",
        "chunked": False,
        "admission": False,
        "guard": False,
        "desc": "static batching (request-level), no chunked prefill",
    },
    "cont-nochunk": {
        "policy": "fcfs",
        "chunked": False,
        "admission": False,
        "guard": False,
        "desc": "continuous batching, FCFS, no chunked prefill",
    },
    "cont-chunk": {
        "policy": "fcfs",
        "chunked": True,
        "admission": False,
        "guard": True,
        "desc": "continuous batching, FCFS, chunked prefill, each step's prefill "
        "sized by the TPOT SLO guard",
    },
    "cont-chunk-fixed": {
        "policy": "fcfs",
        "chunked": True,
        "admission": False,
        "guard": False,
        "desc": "continuous batching, FCFS, chunked prefill at the fixed token budget",
    },
    "priority": {
        "policy": "priority",
        "chunked": True,
        "admission": False,
        "guard": True,
        "desc": "continuous + chunked, priority policy with aging, TPOT SLO guard",
    },
    "cont-chunk+adm": {
        "policy": "fcfs",
        "chunked": True,
        "admission": True,
        "guard": True,
        "desc": "cont-chunk behind SLO-aware admission",
    },
    "priority+adm": {
        "policy": "priority",
        "chunked": True,
        "admission": True,
        "guard": True,
        "desc": "priority behind SLO-aware admission",
    },
}


def engine_config(
    args: argparse.Namespace, policy: str, chunked: bool, guard: bool, budget: int | None = None
) -> dict[str, Any]:
    """``EngineConfig`` fields of one config (shared sizes from the command line)."""
    if budget is None:
        budget = args.chunk_budget if chunked else args.nochunk_budget
    return {
        "policy": policy,
        "enable_chunked_prefill": chunked,
        "max_num_batched_tokens": budget,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": args.num_kv_blocks,
        "block_size": 16,
        "seed": args.seed,
        "tpot_slo_guard": guard and not args.no_tpot_guard,
        **(
            {"tpot_slo_guard_target": args.tpot_guard_target}
            if guard and args.tpot_guard_target is not None
            else {}
        ),
    }


def named_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    c = CONFIGS[name]
    return engine_config(args, c["policy"], c["chunked"], c["guard"])


def slo_of(classes) -> rp.SloOf:
    """A class name -> (TTFT SLO, TPOT SLO) lookup over ``policies`` traffic classes."""
    return lambda c: (classes[c].ttft_slo_s, classes[c].tpot_slo_s)


async def measure_capacity(wl: Window, args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop of C clients on cont-chunk-fixed (raw throughput, without the TPOT
    guard's prefill caps); req/s, and the step-time model's SLO-based estimate."""
    from policies import DEFAULT_CLASSES

    target, load_s = await start_engine(named_config("cont-chunk-fixed", args))
    run = await loadgen.closed_loop(
        target,
        lambda i: wl.request(i % args.capacity_rows, f"cap-{i}", cls="interactive"),
        concurrency=args.capacity_concurrency,
        duration_s=args.capacity_duration,
    )
    idle = await wait_idle(target)
    a, b, c = target.engine.step_time_model.coefficients()
    await stop_engine(target)
    p_mean, o_mean = wl.mean_lengths(args.capacity_rows)
    slo = DEFAULT_CLASSES["interactive"].tpot_slo_s
    denom = b * p_mean + c * o_mean
    return {
        "method": f"closed loop, {args.capacity_concurrency} clients, cont-chunk-fixed engine, "
        f"{args.capacity_duration:.0f} s, requests = first {args.capacity_rows} "
        "window rows cycled",
        "measured_rps": run.requests_per_s,
        "completed": run.completed,
        "partial_equiv": run.partial,
        "output_tok_s": run.output_tokens / run.wall_s,
        "ttft_p50_s": rp.percentile(run.ttft_s, 50),
        "wall_s": run.wall_s,
        "engine_load_s": load_s,
        "step_coefficients": [a, b, c],
        "mean_prompt": p_mean,
        "mean_output": o_mean,
        "model_slo_rps": (1 - a / slo) / denom if denom > 0 and a < slo else None,
        "model_formula": "(1 - a / TPOT_slo_interactive) / (b * mean_prompt + c * mean_output)",
        "blocks_ok": idle["blocks_ok"],
        "engine_error": idle["engine_error"],
    }


def prediction_summary(recs: list[dict]) -> dict[str, Any] | None:
    """The admission model's TTFT predictions against TTFT measured from the same moment."""
    from policies import PredictionLog

    log, per_cls, signed = PredictionLog(maxlen=None), {}, []
    for r in recs:
        if r.get("pred_ttft_s") is None or r["first_token_s"] is None:
            continue
        p, a = r["pred_ttft_s"], r["first_token_s"] - r["send_s"] - r["held_s"]
        log.record(p, a)
        signed.append(p - a)
        per_cls.setdefault(r["class"], PredictionLog(maxlen=None)).record(p, a)
    if not len(log):
        return None
    s = log.summary()
    s["count"] = int(s["count"])
    s["mean_signed_error_s"] = statistics.fmean(signed)
    s["p90_abs_error_s"] = rp.percentile([abs(x) for x in signed], 90)
    s["by_class"] = {k: {**v.summary(), "count": len(v)} for k, v in per_cls.items()}
    return s


async def run_point(
    target, wl: Window, args: argparse.Namespace, name: str, x: float, capacity: float, classes
) -> dict[str, Any]:
    """One load of one config: replay, judge, summarize."""
    reqs, scale = wl.at_rate(x * capacity, args.duration, tag=f"{name}-{x:g}")
    run, info = await run_open(target, reqs, cutoff_s=args.duration + args.drain)
    summ = rp.summarize(run.records, len(reqs) / args.duration, slo_of(classes), run.wall_s)
    return {
        "load_x": x,
        "rate_nominal": x * capacity,
        "rate": summ["rate"],
        "time_scale": scale,
        "rows": [reqs[0].row, reqs[-1].row],
        "summary": summ,
        "goodput_rate": summ["slo_met"] / args.duration,
        "prediction": prediction_summary(run.records),
        "refusals_sample": sorted(
            {(r["error"] or "").split(";")[0] for r in run.records if r["status"] == "refused"}
        )[:3],
        **info,
        "records": [rp.compact_record(r) for r in run.records],
    }


def _line(name: str, p: dict[str, Any]) -> str:
    a = p["summary"]
    i = a.get("per_class", {}).get("interactive", a)
    return (
        f"[{name}] load {p['load_x']:g}x ({p['rate']:.2f} req/s, {a['requests']} req): "
        f"attain {rp.pct(a['attainment'])} (int {rp.pct(i['attainment'])}), refused "
        f"{a['refused']}, cut {a['cut_off']}, int TTFT p99 {rp.fmt(i['ttft_s']['p99'])} s, "
        f"TPOT p99 {rp.fmt(i['tpot_s']['p99'], '.3f')} s, "
        f"{a['output_tokens_per_s']:.1f} tok/s, wall {p['wall_s']:.0f} s, other load "
        f"{rp.fmt(p['foreign_cores'])}" + ("" if p["blocks_ok"] else "  BLOCKS LEAKED")
    )


def next_load(points: list[dict], extra: int, refine: int) -> tuple[float | None, int, int]:
    """The load to add once the grid is done: half the lowest when even it misses 90%
    (so goodput is bracketed), else the middle of the goodput bracket; None: none."""
    low = min(points, key=lambda p: p["load_x"])
    if extra > 0 and low["summary"]["attainment"] < rp.GOODPUT_ATTAINMENT:
        return low["load_x"] / 2, extra - 1, refine
    g = rp.goodput([p["summary"] for p in points])
    if refine > 0 and g["bound"] == "bracketed":
        x0, x1 = (next(p["load_x"] for p in points if p["rate"] == r) for r in g["bracket"])
        return (x0 + x1) / 2, extra, refine - 1
    return None, extra, refine


async def run_config(
    wl: Window, args: argparse.Namespace, capacity: float, name: str
) -> dict[str, Any]:
    """One config over ``args.loads`` (plus the added points); its points and goodput."""
    from policies import DEFAULT_CLASSES

    cfg, config = CONFIGS[name], named_config(name, args)

    async def start():
        return await start_engine(
            config, args.step_log, admission=cfg["admission"], predict=cfg["policy"] != "static"
        )

    target, load_s = await start()
    print(f"[{name}] engine ready ({load_s:.1f} s with warm-up): {config}", flush=True)
    classes = target.engine.traffic_classes or DEFAULT_CLASSES
    points, todo = [], list(args.loads)
    extra, refine = args.extra_low_points, args.goodput_refine
    while todo:
        points.append(await run_point(target, wl, args, name, todo.pop(0), capacity, classes))
        print(_line(name, points[-1]), flush=True)
        if not points[-1]["blocks_ok"] or points[-1]["engine_error"]:
            print(f"[{name}] engine left in a bad state; restarting it", flush=True)
            await stop_engine(target)
            target, _ = await start()
        if not todo:
            x, extra, refine = next_load(points, extra, refine)
            if x is not None:
                print(f"[{name}] adding load {x:g}x", flush=True)
                todo.append(x)
    await stop_engine(target)
    points.sort(key=lambda p: p["load_x"])
    return {
        "config": config,
        "admission": cfg["admission"],
        "desc": cfg["desc"],
        "points": points,
        "goodput": rp.goodput([p["summary"] for p in points]),
    }
