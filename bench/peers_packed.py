"""Packed weights served: iterserve against llama.cpp's ``llama-server`` on the same GGUF and
against its own fp32 path, side by side in one run (a phase of :mod:`bench.peers`).

Systems, all over HTTP, each with every core of the machine (llama-server ``-t``/``-tb`` the
core count, iterserve's one in-process replica its default threads):

* ``iterserve``: ``iterserve serve`` with its defaults: the embedded GGUF kept packed
  (Q4_1 layers, Q8_0 embedding and LM head; ``quantization: auto``);
* ``iterserve-fp32``: the same with ``quantization: none`` (the file de-quantized to fp32);
* ``llama.cpp``: ``llama-server`` on the same file, built by :mod:`bench.toolkit.llamacpp`,
  with ``--parallel`` equal to each measure's concurrency (one server per concurrency:
  1, 8 and 32 slots) and ``-c`` room for every slot's longest request.

Measures, each taken in ``--packed-rounds`` rounds that alternate the systems' order (every
server loaded and idle while another is measured), median and spread over the rounds:

* one stream: steady-state ms between streamed tokens of one greedy request of 128 tokens;
* 8 streams: the same with 8 requests at once (ms per decode step);
* 32 trace requests at once: output tokens per second of the window's first 32 rows
  (lengths divided by the suite's scale), all sent at once, other prompt text each round;
* prefill 512: seconds to the first token of a 512-token prompt (new text each time);

then served goodput on the trace window at the suite's SLOs (each system alone, the
suite's grid of rates extended while it passes), and one stream on a K-quant file made from
the embedded one with ``llama-quantize --allow-requantize`` (``Q4_K_M``: Q4_K, Q6_K, and the
fallbacks llama.cpp picks where a row is not a multiple of 256 weights).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import yaml

from bench.toolkit import REPO, llamacpp, loadgen
from bench.toolkit import serve_bench as sb
from bench.toolkit import servers as ps
from bench.toolkit.loadgen import LoadRequest
from bench.toolkit.prompts import prompt_maker
from bench.toolkit.targets import AiohttpTarget, aiohttp_session

BASE_PORT = 8140
PACKED = {"quantization": "auto"}
"""iterserve's own default (the suites' servers default to fp32: ``servers.FP32_ENGINE``)."""
STREAM_TOKENS = 128
PREFILL_TOKENS = 512
TRACE32 = 32
K_QUANT = "Q4_K_M"
LLAMA_SLOTS = (1, 8, 32)
"""llama-server's ``--parallel`` for the measures at each concurrency (the replay uses the
largest)."""
MEASURES = (
    # key, name, higher is better
    ("stream1_ms", "one stream (ms per token)", False),
    ("stream8_ms", "8 streams (ms per step)", False),
    ("trace32_tok_s", "32 trace requests at once (output tok/s)", True),
    ("prefill512_s", f"prefill of a {PREFILL_TOKENS}-token prompt (s to first token)", False),
)


def iterserve_proc(
    label: str,
    port: int,
    engine: dict,
    slo: tuple[float, float],
    tmp: Path,
    model: Path | None = None,
) -> ps.Process:
    """``iterserve serve`` with ``engine`` over the suites' settings, on ``port``."""
    cfg = ps.iterserve_config(ps.SystemSpec(label, "iterserve", engine), slo, mix=False)
    cfg["port"] = port
    if model is not None:
        cfg["model"], cfg["served_model_name"] = str(model), ps.MODEL_NAME
    path = tmp / f"{label}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [str(REPO / ".venv/bin/iterserve"), "serve", "--config", str(path)]
    return ps.Process(label, cmd, f"http://127.0.0.1:{port}")


def llama_proc(label: str, gguf: Path, port: int, slots: int) -> ps.Process:
    """``llama-server`` on ``gguf`` with ``slots`` slots, on ``port``."""
    # Room for the longest trace request (1024 prompt + 512 output tokens) in every slot.
    ctx = slots * 2048
    cmd = llamacpp.server_command(gguf, port, os.cpu_count() or 1, slots, ctx, ps.MODEL_NAME)
    return ps.Process(label, cmd, f"http://127.0.0.1:{port}")


def start(stack: contextlib.ExitStack, server: ps.Process) -> ps.Process:
    """``server`` started, and stopped when ``stack`` closes (the last started first)."""
    print(f"[packed] starting {server.label}", flush=True)
    return stack.enter_context(server)


# -- the measures --------------------------------------------------------------------------


def _bench_config(
    args, server: ps.Process, num_requests: int, rates: list[float]
) -> sb.BenchConfig:
    return sb.BenchConfig(
        base_url=server.url,
        model=server.model_name,
        tokenizer=args.tokenizer,
        trace=args.trace,
        window_start=args.window_start,
        num_requests=num_requests,
        rates=rates,
        length_scale=args.length_scale,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        max_duration_s=args.max_rate_s,
        label=server.label,
        class_header=None,
        warmup=2,
    )


async def _open_loop(server: ps.Process, requests: list[LoadRequest]) -> loadgen.OpenLoopRun:
    """Every request to the end: iterserve gets them in its ``batch`` class, which admission
    never refuses (a throughput measure, not a latency one; llama.cpp queues them all)."""
    cls = "batch" if server.label.startswith("iterserve") else None
    requests = [replace(r, cls=cls) for r in requests]
    async with aiohttp_session() as client:
        target = AiohttpTarget(
            client, server.url, server.model_name, class_header=ps.CLASS_HEADER if cls else None
        )
        run = await loadgen.open_loop(target, requests)
    bad = [r["error"] for r in run.records if r["status"] != "finished"]
    if bad:
        raise RuntimeError(f"{server.label}: {bad[0]}")
    return run


async def trace32(args, server: ps.Process, replay: int) -> float:
    """Output tok/s of the window's first 32 rows sent at once (prompt text of ``replay``)."""
    cfg = _bench_config(args, server, TRACE32, [1.0])
    work = [replace(r, arrival_s=0.0) for r in sb.build_workload(cfg, 1.0, replay=1000 + replay)]
    run = await _open_loop(server, work)
    return sum(r["output_tokens"] for r in run.records) / run.wall_s


async def prefill(args, server: ps.Process, replay: int) -> float:
    """Seconds to the first token of a new 512-token prompt (one output token)."""
    text, got = prompt_maker(args.tokenizer, 0).make(-1, PREFILL_TOKENS, replay=2000 + replay)
    run = await _open_loop(server, [LoadRequest("prefill", -1, None, text, got, 1)])
    return run.records[0]["first_token_s"] - run.records[0]["send_s"]


async def measure_round(args, systems: dict[str, dict[int, ps.Process]], r: int) -> dict:
    """Every measure once per system, the systems in round ``r``'s order."""
    names = list(systems)[:: 1 if r % 2 == 0 else -1]
    out: dict = {}
    for name in names:
        by_slots = systems[name]
        one, eight, many = (by_slots[n] if n in by_slots else by_slots[0] for n in LLAMA_SLOTS)
        tokens = 16 if args.quick else STREAM_TOKENS
        out[name] = {
            "stream1_ms": (await ps.token_cost(one, 1, tokens))["ms_per_token"],
            "stream8_ms": (await ps.token_cost(eight, 8, tokens))["ms_per_token"],
            "trace32_tok_s": await trace32(args, many, r),
            "prefill512_s": await prefill(args, one, r),
        }
        print(f"[packed] round {r + 1} {name}: {out[name]}", flush=True)
    return out


def summarize(rounds: list[dict]) -> dict:
    """Per system and measure: median, min, max over the rounds; per measure, iterserve's
    ratio to each other system per round (speed: >1 is iterserve faster) and its median."""
    out: dict = {"systems": {}, "ratios": {}}
    for name in rounds[0]:
        out["systems"][name] = {
            key: {
                "median": statistics.median(r[name][key] for r in rounds),
                "min": min(r[name][key] for r in rounds),
                "max": max(r[name][key] for r in rounds),
                "rounds": [r[name][key] for r in rounds],
            }
            for key, _, _ in MEASURES
        }
    for other in [n for n in rounds[0] if n != "iterserve"]:
        out["ratios"][other] = {}
        for key, _, higher in MEASURES:
            per = [
                r["iterserve"][key] / r[other][key]
                if higher
                else r[other][key] / r["iterserve"][key]
                for r in rounds
            ]
            out["ratios"][other][key] = {"median": statistics.median(per), "rounds": per}
    return out


async def goodput(args, server: ps.Process) -> dict:
    cfg = _bench_config(args, server, args.num_requests, args.rates)
    cfg.extend_rates = args.packed_extend_rates
    rep = await sb.run(cfg)
    return {
        "goodput": rep["goodput"]["overall"],
        "summaries": [
            {
                k: s[k]
                for k in (
                    "rate",
                    "attainment",
                    "output_tokens_per_s",
                    "ttft_s",
                    "tpot_s",
                    "meets_target",
                    "refused",
                    "failed",
                )
            }
            for s in rep["summaries"]
        ],
    }


# -- the phase -----------------------------------------------------------------------------


def expected_s(args) -> float:
    """Rough wall time: the build where needed, starts, rounds, replays, the K-quant row."""
    build = 0 if llamacpp.built() else llamacpp.EXPECTED_BUILD_S
    rounds = args.packed_rounds * 3 * (25 if not args.quick else 8)
    rates = len(args.rates) + args.packed_extend_rates
    replays = 3 * sum(
        min(args.num_requests / r + 6, args.max_rate_s + 10)
        for r in [*args.rates, *(args.rates[-1] * 1.25**j for j in range(1, rates))][:rates]
    )
    return build + 60 + rounds + replays + 90


def run(args: argparse.Namespace) -> dict:
    """The whole phase; its report (``"run"``: :func:`bench.toolkit.report.run_record`)."""
    from bench.toolkit import report as rp
    from engine.model.loader import default_gguf_path

    t0 = time.monotonic()
    print(f"[packed] expected duration ~{expected_s(args) / 60:.0f} min", flush=True)
    llamacpp.ensure_built()
    gguf = default_gguf_path()
    args.tokenizer = ps.model_dir()
    slo = (args.slo_ttft_s, args.slo_tpot_s)
    report: dict = {"gguf": gguf.name, "weights": {}}
    with tempfile.TemporaryDirectory(prefix="packed-") as tmp, contextlib.ExitStack() as stack:
        port = iter(range(BASE_PORT, BASE_PORT + 20))
        fp32 = {"quantization": "none"}
        systems = {
            "iterserve": {
                0: start(stack, iterserve_proc("iterserve", next(port), PACKED, slo, Path(tmp)))
            },
            "iterserve-fp32": {
                0: start(stack, iterserve_proc("iterserve-fp32", next(port), fp32, slo, Path(tmp)))
            },
            "llama.cpp": {
                n: start(stack, llama_proc(f"llama.cpp-p{n}", gguf, next(port), n))
                for n in LLAMA_SLOTS
            },
        }
        for name, by in systems.items():
            server = by[min(by)]
            report["weights"][name] = "the GGUF as stored"
            if name.startswith("iterserve"):  # as the server itself says
                info = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
                mib = info["weight_bytes"] / 2**20
                report["weights"][name] = f"{info['weight_format']}, {mib:.0f} MiB"
        asyncio.run(_warm(systems))
        rounds = [asyncio.run(measure_round(args, systems, r)) for r in range(args.packed_rounds)]
        report["rounds"] = rounds
        report["summary"] = summarize(rounds)
        report["goodput"] = {}
        for name, by in systems.items():
            server = by[max(by)]
            print(f"[packed] goodput replay: {name}", flush=True)
            report["goodput"][name] = asyncio.run(goodput(args, server))
    report["k_quant"] = k_quant_row(args, gguf, slo)
    report["wall_s"] = time.monotonic() - t0
    report["run"] = rp.run_record()
    return report


async def _warm(systems: dict[str, dict[int, ps.Process]]) -> None:
    for by in systems.values():
        for server in by.values():
            await ps.token_cost(server, 1, 8, warmup=False)


def k_quant_row(args, gguf: Path, slo: tuple[float, float]) -> dict:
    """One stream on a Q4_K_M file made from the embedded GGUF, both systems, and which
    formats iterserve kept packed."""
    kq = llamacpp.quantize(gguf, llamacpp.HOME / f"{gguf.stem}.{K_QUANT}.gguf", K_QUANT)
    out: dict = {"file": kq.name, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="packed-kq-") as tmp, contextlib.ExitStack() as stack:
        it = start(stack, iterserve_proc("iterserve", BASE_PORT + 30, PACKED, slo, Path(tmp), kq))
        ll = start(stack, llama_proc("llama.cpp", kq, BASE_PORT + 31, 1))
        info = httpx.get(f"{it.url}/v1/models", timeout=10).json()["data"][0]
        out["iterserve_weights"] = info.get("weight_format")
        asyncio.run(_warm({"a": {0: it}, "b": {0: ll}}))
        tokens = 16 if args.quick else STREAM_TOKENS
        for r in range(args.packed_rounds):
            pair = [("iterserve", it), ("llama.cpp", ll)][:: 1 if r % 2 == 0 else -1]
            out["rounds"].append(
                {n: asyncio.run(ps.token_cost(s, 1, tokens))["ms_per_token"] for n, s in pair}
            )
    for name in ("iterserve", "llama.cpp"):
        out[name] = statistics.median(r[name] for r in out["rounds"])
    return out


# -- the report ----------------------------------------------------------------------------

TARGETS = {
    "stream1_llama": 1.0,
    "fp32_speedup": 1.5,
    "llama_speed": 1.0,
    "prefill_slower": 0.10,
    "goodput_fp32": 1.3,
}


def _spread(m: dict, fmt: str) -> str:
    return f"{m['median']:{fmt}} ({m['min']:{fmt}}-{m['max']:{fmt}})"


def section(rep: dict) -> tuple[list[str], list[dict]]:
    """Markdown lines and targets of the phase's report."""
    s, w = rep["summary"], rep["weights"]
    n = len(rep["rounds"])
    lines = [
        "## Packed weights: iterserve, its fp32 path and llama.cpp on the same GGUF",
        "",
        f"`{rep['gguf']}` served by each system over HTTP, every core each. Weights: "
        + "; ".join(f"{k}: {v}" for k, v in w.items())
        + f". {n} rounds alternating the systems' order; each cell is the median over the "
        "rounds (min-max).",
        "",
        "| measure | "
        + " | ".join(s["systems"])
        + " | iterserve vs fp32 | iterserve vs llama.cpp |",
        "|---|" + "---:|" * (len(s["systems"]) + 2),
    ]
    for key, name, _ in MEASURES:
        fmt = ".1f" if key != "prefill512_s" else ".3f"
        cells = [_spread(s["systems"][sys_][key], fmt) for sys_ in s["systems"]]
        ratios = [
            f"{s['ratios'][o][key]['median']:.2f}x" if o in s["ratios"] else "-"
            for o in ("iterserve-fp32", "llama.cpp")
        ]
        lines.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    lines += [
        "",
        "Ratios are speed ratios (>1: iterserve faster), the median of the rounds' ratios.",
        "",
        "Served goodput on the trace (highest offered rate with 90% of requests within both "
        "SLOs): " + ", ".join(f"{k} {v['goodput']} req/s" for k, v in rep["goodput"].items()) + ".",
        "",
    ]
    kq = rep.get("k_quant")
    if kq:
        lines += [
            f"K-quant file `{kq['file']}` (made with llama-quantize --allow-requantize; iterserve "
            f"holds it as {kq.get('iterserve_weights')}): one stream {kq['iterserve']:.2f} ms per "
            f"token (iterserve) and {kq['llama.cpp']:.2f} (llama.cpp), medians of "
            f"{len(kq['rounds'])} rounds.",
            "",
        ]
    r = s["ratios"]
    targets = [
        {
            "target": "one stream: iterserve ms/token <= llama.cpp's",
            "value": f"{s['systems']['iterserve']['stream1_ms']['median']:.2f} / "
            f"{s['systems']['llama.cpp']['stream1_ms']['median']:.2f} ms",
            "bar": "<= 1.0x",
            "met": r["llama.cpp"]["stream1_ms"]["median"] >= TARGETS["stream1_llama"],
        }
    ]
    for key in ("stream8_ms", "trace32_tok_s"):
        name = next(nm for k, nm, _ in MEASURES if k == key)
        for other, bar in (("iterserve-fp32", "fp32_speedup"), ("llama.cpp", "llama_speed")):
            v = r[other][key]["median"]
            targets.append(
                {
                    "target": f"{name}: iterserve / {other}",
                    "value": f"{v:.2f}x",
                    "bar": f">= {TARGETS[bar]}x",
                    "met": v >= TARGETS[bar],
                }
            )
    slower = 1 / r["iterserve-fp32"]["prefill512_s"]["median"] - 1
    targets.append(
        {
            "target": "prefill 512: iterserve slower than its fp32 path by",
            "value": f"{100 * slower:.0f}%",
            "bar": "<= 10%",
            "met": slower <= TARGETS["prefill_slower"],
        }
    )
    g, gf = rep["goodput"]["iterserve"]["goodput"], rep["goodput"]["iterserve-fp32"]["goodput"]
    ratio = (g or 0) / gf if gf else None
    targets.append(
        {
            "target": "served goodput, iterserve / its fp32 path",
            "value": f"{g} / {gf} req/s" + (f" = {ratio:.2f}x" if ratio else ""),
            "bar": ">= 1.3x",
            "met": ratio is not None and ratio >= TARGETS["goodput_fp32"] - 1e-3,
        }
    )
    return lines, targets
