"""Open-loop load generator for any OpenAI-compatible ``/v1/completions`` endpoint.

Run from the repository root (the server must already be up)::

    python -m bench.toolkit.serve_bench --base-url http://127.0.0.1:8000 --model NAME \\
        --tokenizer DIR --rates 2,3,5,8 --label iterserve

Workload
    A window of the Azure LLM inference trace 2023 (Patel et al., "Splitwise: Efficient
    Generative LLM Inference Using Phase Splitting", ISCA 2024; CC-BY 4.0): rows
    ``--window-start`` .. ``+--num-requests`` of ``deploy/sim/traces/azure_llm_2023_conv.csv``
    (or ``_code.csv``; columns TIMESTAMP, ContextTokens, GeneratedTokens). The real
    inter-arrival times are rescaled per offered rate R so that the N requests span N/R
    seconds (the row after the window would arrive at N/R). Open loop: every request is sent
    at its arrival time whatever happened to earlier ones.
    Lengths: prompt = clamp(round(ContextTokens / length_scale), 4, 1024) tokens, output =
    clamp(round(GeneratedTokens / output_scale), 1, 512) tokens, forced with ``max_tokens``
    and ``ignore_eos``, greedy. Prompts are real English text (docstrings of the top-level
    standard-library modules, parsed with ``ast``, never imported) cut to the exact token
    length under the served model's tokenizer.

Metrics (vLLM's definitions; all in seconds)
    TTFT: scheduled arrival -> first chunk with text (so generator lag counts against it;
    the lag is reported). E2E: scheduled arrival -> end of stream. TPOT: (E2E - TTFT) /
    (output tokens - 1), 0 for one-token outputs. ITL: gaps between successive text chunks.
    A request meets the SLO iff it got status 200, no error event, all its output tokens,
    TTFT <= ``--slo-ttft-s`` and TPOT <= ``--slo-tpot-s``; refusals (429) and failures are
    misses. Goodput (DistServe, Zhong et al., OSDI 2024) is the highest offered rate whose
    attainment is at least ``--attainment-target``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.toolkit import RESULTS, cli, loadgen
from bench.toolkit import report as rp
from bench.toolkit.loadgen import LoadRequest
from bench.toolkit.prompts import CORPUS_DESCRIPTION, prompt_maker
from bench.toolkit.targets import HttpTarget, completions_url, http_client
from bench.toolkit.workload import (
    ATTRIBUTION,
    TRACE,
    Lengths,
    arrival_offsets,
    pick_class,
    read_trace,
)

WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 16, 8
RATE_ALLOWANCE_S = 20.0  # per rate, on top of N/R: drain, cooldown, stragglers


@dataclass
class BenchConfig:
    """All options of the benchmark; times in seconds, lengths in tokens, rates in req/s."""

    base_url: str  # server root (``http://host:port``), ``/v1`` root or the full endpoint
    model: str  # the ``model`` field sent; must be the name the server serves
    tokenizer: str  # local transformers directory of the served model's tokenizer
    trace: str = str(TRACE)
    window_start: int = 0  # index of the first data row used
    num_requests: int = 120
    rates: list[float] = field(default_factory=lambda: [2.0, 3.0, 5.0, 8.0])
    length_scale: float = 8.0  # trace token counts are divided by this
    output_scale: float | None = None  # divisor for output lengths; None: length_scale
    min_prompt: int = 4
    max_prompt: int = 1024
    max_output: int = 512
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    class_mix: dict[str, float] | None = None  # class -> weight; None: no classes
    class_header: str | None = "x-iterserve-class"  # None/"": send no class header
    priority_field: bool = False  # send the class's ``priority`` in the JSON body
    class_priority: dict[str, int] = field(default_factory=lambda: {"interactive": 0, "batch": 10})
    attainment_target: float = 0.9
    warmup: int = 4  # short sequential requests sent (and discarded) before the first rate
    cooldown_s: float = 2.0
    max_duration_s: float = 600.0  # per rate; requests still running are cancelled (failed)
    timeout_s: float = 600.0  # httpx timeout per request
    seed: int = 0
    label: str = "server"
    extra_headers: dict[str, str] = field(default_factory=dict)
    # Past the listed rates: up to ``extend_rates`` more, each ``extend_factor`` times the
    # last, while the last met the attainment target (of ``extend_class``, else overall),
    # so that a faster host still sees the system's limit; then, with ``limit_factor``,
    # one rate at that factor times the highest passing rate, if above every rate run.
    extend_rates: int = 0
    extend_factor: float = 1.25
    extend_class: str | None = None
    limit_factor: float | None = None

    @property
    def lengths(self) -> Lengths:
        return Lengths(
            self.length_scale,
            self.output_scale or self.length_scale,
            self.min_prompt,
            self.max_prompt,
            1,
            self.max_output,
        )


def build_workload(cfg: BenchConfig, rate: float, replay: int = 0) -> list[LoadRequest]:
    """The window's requests at ``rate`` req/s: arrivals (s), text prompts, lengths, class.

    ``replay`` (the rate's index): the same lengths, arrivals and classes with other
    prompt text (see :meth:`prompts.PromptMaker.make`).
    """
    if cfg.num_requests < 1 or rate <= 0:
        raise ValueError("need num_requests >= 1 and a positive rate")
    if cfg.priority_field and cfg.class_mix:
        missing = set(cfg.class_mix) - set(cfg.class_priority)
        if missing:
            raise ValueError(f"no --class-priority for classes {sorted(missing)}")
    rows = read_trace(cfg.trace, cfg.window_start, cfg.num_requests)
    offsets, _ = arrival_offsets(rows, cfg.num_requests, rate)
    maker = prompt_maker(cfg.tokenizer, cfg.seed)
    out = []
    for r, at in zip(rows, offsets):
        text, got = maker.make(r.row, cfg.lengths.prompt(r.context_tokens), replay)
        out.append(
            LoadRequest(
                f"{cfg.label}-{rate:g}-r{r.row}",
                r.row,
                pick_class(cfg.class_mix, cfg.seed, r.row),
                text,
                got,
                cfg.lengths.output(r.generated_tokens),
                at,
            )
        )
    return out


def target(cfg: BenchConfig, client) -> HttpTarget:
    return HttpTarget(
        client,
        cfg.base_url,
        cfg.model,
        class_header=cfg.class_header,
        priority_field=cfg.priority_field,
        class_priority=cfg.class_priority,
        extra_headers=cfg.extra_headers,
    )


async def run_rate(
    cfg: BenchConfig, workload: list[LoadRequest], rate: float, client
) -> dict[str, Any]:
    """Replay ``workload`` at its arrivals; {"summary": ..., "records": [...]} (times in s)."""
    run = await loadgen.open_loop(target(cfg, client), workload, cutoff_s=cfg.max_duration_s)
    for rec in run.records:
        rec["rate"] = rate
        if rec["status"] == "cut_off":
            rec["error"] = f"cancelled after max_duration_s={cfg.max_duration_s}"
    summary = rp.summarize(
        run.records,
        rate,
        lambda _: (cfg.slo_ttft_s, cfg.slo_tpot_s),
        run.wall_s,
        cfg.attainment_target,
    )
    return {"summary": summary, "records": [rp.compact_record(r) for r in run.records]}


def expected_duration_s(cfg: BenchConfig) -> float:
    """Rough wall time (s): N/R plus an allowance per rate, warmup and cooldowns; with
    every extension of :func:`next_rate` run (at most)."""
    rates = cfg.rates + [
        cfg.rates[-1] * cfg.extend_factor**j
        for j in range(1, cfg.extend_rates + 1 + bool(cfg.limit_factor))
    ]
    return (
        sum(cfg.num_requests / r + RATE_ALLOWANCE_S for r in rates)
        + cfg.warmup * 1.0
        + cfg.cooldown_s * max(0, len(rates) - 1)
    )


async def _warmup(cfg: BenchConfig, client) -> int:
    """Send ``cfg.warmup`` short requests one after another; return how many failed."""
    text, got = prompt_maker(cfg.tokenizer, cfg.seed).make(-1, WARMUP_PROMPT_TOKENS)
    req = LoadRequest("warmup", -1, None, text, got, WARMUP_OUTPUT_TOKENS)
    failed = 0
    for _ in range(cfg.warmup):
        run = await loadgen.open_loop(target(cfg, client), [req])
        failed += run.records[0]["status"] != "finished"
    return failed


def _window_info(cfg: BenchConfig, workload: list[LoadRequest]) -> dict[str, Any]:
    maker = prompt_maker(cfg.tokenizer, cfg.seed)
    rows = read_trace(cfg.trace, cfg.window_start, cfg.num_requests)
    return {
        "first_row": workload[0].row,
        "last_row": workload[-1].row,
        "num_requests": len(workload),
        "trace_span_s": rows[-1].offset_s,
        "prompt_tokens_total": sum(r.prompt_tokens for r in workload),
        "output_tokens_total": sum(r.max_tokens for r in workload),
        "classes": {c: sum(r.cls == c for r in workload) for c in (cfg.class_mix or {})},
        "corpus": CORPUS_DESCRIPTION,
        "corpus_sha256": maker.corpus_sha256,
        "tokenizer_special_tokens": maker.special,
    }


def next_rate(cfg: BenchConfig, summaries: list[dict[str, Any]]) -> float | None:
    """The rate to replay after ``summaries`` (one per rate run, in order), or None: the
    listed rates, then the extensions and the limit rate of :class:`BenchConfig`."""
    done = len(summaries)
    if done < len(cfg.rates):
        return cfg.rates[done]
    if done > len(cfg.rates) + cfg.extend_rates:  # the limit rate ran: stop
        return None

    def passed(s: dict[str, Any]) -> bool:
        att = (
            s["per_class"][cfg.extend_class]["attainment"] if cfg.extend_class else s["attainment"]
        )
        return att >= cfg.attainment_target

    last, top = summaries[-1], max(s["rate"] for s in summaries)
    if done < len(cfg.rates) + cfg.extend_rates and passed(last) and last["rate"] == top:
        return round(top * cfg.extend_factor, 3)
    good = [s["rate"] for s in summaries if passed(s)]
    # Rounded up: the mix targets are judged at the first rate at or above 1.5x the limit.
    if cfg.limit_factor and good:
        limit = math.ceil(max(good) * cfg.limit_factor * 1000 - 1e-6) / 1000
        return limit if limit > top else None
    return None


async def run(cfg: BenchConfig) -> dict[str, Any]:
    """Warm up, replay every rate in ``cfg.rates`` (and the extensions :func:`next_rate`
    asks for), compute goodput; the JSON-able report."""
    print(
        f"[serve_bench] {cfg.label}: expected duration ~{expected_duration_s(cfg):.0f} s "
        f"(at most {len(cfg.rates) + cfg.extend_rates + bool(cfg.limit_factor)} rates x "
        f"{cfg.num_requests} requests; N/R + "
        f"{RATE_ALLOWANCE_S:.0f} s each; cap {cfg.max_duration_s:.0f} s per rate)",
        flush=True,
    )
    summaries, records = [], []
    async with http_client(cfg.timeout_s) as client:
        if cfg.warmup and (failed := await _warmup(cfg, client)):
            print(
                f"[serve_bench] warning: {failed}/{cfg.warmup} warmup requests failed",
                file=sys.stderr,
            )
        rate, i = cfg.rates[0], 0
        while rate is not None:
            if i:
                await asyncio.sleep(cfg.cooldown_s)
            workload = build_workload(cfg, rate, replay=i)
            print(
                f"[serve_bench] rate {rate:g} req/s: {len(workload)} requests over "
                f"{len(workload) / rate:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            result = await run_rate(cfg, workload, rate, client)
            summaries.append(result["summary"])
            if (result["summary"]["max_lag_s"] or 0) > 0.05:  # TTFT includes this lag
                print(
                    f"[serve_bench] warning: generator fell behind by up to "
                    f"{result['summary']['max_lag_s']:.3f} s",
                    file=sys.stderr,
                )
            records.extend(result["records"])
            i += 1
            rate = next_rate(cfg, summaries)
    classes = sorted(cfg.class_mix or {})
    good = rp.goodput(summaries, cfg.attainment_target)
    return {
        "benchmark": "serve_bench",
        "label": cfg.label,
        "config": asdict(cfg),
        "endpoint": completions_url(cfg.base_url),
        "trace": {"path": cfg.trace, "attribution": ATTRIBUTION},
        "window": _window_info(cfg, workload),
        "scaling": (
            "arrival_i = (t_i - t_0) * N / (R * (t_N - t_0)), t_N the row after the "
            "window, so N requests span N/R s; " + cfg.lengths.describe()
        ),
        "slo": {
            "ttft_s": cfg.slo_ttft_s,
            "tpot_s": cfg.slo_tpot_s,
            "attainment_target": cfg.attainment_target,
        },
        "summaries": summaries,
        "goodput": {
            "overall": good["rps"],
            "detail": good,
            "per_class": {
                c: rp.goodput(summaries, cfg.attainment_target, c)["rps"] for c in classes
            },
        },
        "records": records,
    }


def print_table(report: dict[str, Any]) -> None:
    """One line per rate to stdout: attainment, goodput flag, tok/s, TTFT/TPOT (s), errors."""
    slo = report["slo"]
    print(
        f"\n{report['label']}  (SLO: TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s; "
        f"'*' = attainment >= {slo['attainment_target']})"
    )
    rows = []
    for s in report["summaries"]:
        classes = " ".join(f"{c}={v['attainment']:.2f}" for c, v in s.get("per_class", {}).items())
        rows.append(
            [
                f"{s['rate']:g}",
                f"{s['attainment']:.3f}{'*' if s['meets_target'] else ''}",
                f"{s['output_tokens_per_s']:.1f}",
                rp.fmt(s["ttft_s"]["p50"], ".3f"),
                rp.fmt(s["ttft_s"]["p99"], ".3f"),
                rp.fmt(s["tpot_s"]["p50"], ".3f"),
                rp.fmt(s["tpot_s"]["p99"], ".3f"),
                str(s["refused"]),
                str(s["failed"] + s["cut_off"]),
                rp.fmt(None if s["mean_lag_s"] is None else 1e3 * s["mean_lag_s"], ".1f"),
                classes or "-",
            ]
        )
    print(
        rp.table(
            [
                "rate",
                "attain",
                "out tok/s",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "refused",
                "failed",
                "lag ms",
                "classes",
            ],
            rows,
            "r" * 10 + "l",
        )
    )
    g = report["goodput"]
    per = " ".join(f"{c}={v}" for c, v in g["per_class"].items())
    print(f"goodput: {g['overall']} req/s{'  per class: ' + per if per else ''}")


# -- command line ------------------------------------------------------------------------


def _mapping(cast):
    def parse(text: str) -> dict:
        pairs = [item.partition("=") for item in text.split(",") if item.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise argparse.ArgumentTypeError(f"expected k=v[,k=v...], got {text!r}")
        return {k.strip(): cast(v) for k, _, v in pairs}

    return parse


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def _parser() -> argparse.ArgumentParser:
    p = cli.parser("bench.toolkit.serve_bench", __doc__)
    d = BenchConfig("", "", "")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--tokenizer", required=True, help="local transformers tokenizer directory")
    p.add_argument("--trace", default=d.trace)
    p.add_argument("--rates", type=cli.floats, default=d.rates, help="offered req/s")
    p.add_argument("--output-scale", type=float, default=None)
    p.add_argument(
        "--class-mix", type=_mapping(float), default=None, help="e.g. interactive=0.7,batch=0.3"
    )
    p.add_argument("--class-header", default=d.class_header, help="'' to send no header")
    p.add_argument("--priority-field", action="store_true")
    p.add_argument("--class-priority", type=_mapping(int), default=d.class_priority)
    p.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        help="extra header NAME:VALUE (repeatable)",
    )
    for name in (
        "window_start",
        "num_requests",
        "min_prompt",
        "max_prompt",
        "max_output",
        "warmup",
        "seed",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in (
        "length_scale",
        "slo_ttft_s",
        "slo_tpot_s",
        "attainment_target",
        "cooldown_s",
        "max_duration_s",
        "timeout_s",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--label", default=d.label)
    cli.add_out(p, str(RESULTS / "serve_bench.json"), "the result file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = vars(_parser().parse_args(argv))
    out = args.pop("out")
    args["extra_headers"] = dict(args.pop("header"))
    args["class_header"] = args["class_header"] or None
    cfg = BenchConfig(**args)
    report = asyncio.run(run(cfg))
    print_table(report)
    rp.write_report(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
