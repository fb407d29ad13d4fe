"""iterserve against vLLM's CPU build, side by side in one run, over HTTP (``make bench-peers``).

Run from the repository root after ``make bench-peers`` created ``.venv-vllm`` (it prints
its expected duration first)::

    python -m bench.peers                      # full run on window 1000
    python -m bench.peers --windows 1000,6000  # and the held-out window 6000 (twice as long)
    python -m bench.peers --quick              # a smoke run of every phase, one window
    python -m bench.peers --base-tree ../old --systems vllm,iterserve,iterserve-base
                                               # before/after: another checkout, same run

Same machine, same weights (the embedded SmolLM2-135M-Instruct converted once into
``$ITERSERVE_CACHE``; vLLM serves that directory), fp32, 2 OpenMP threads for vLLM
(``OMP_NUM_THREADS``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``VLLM_CPU_KVCACHE_SPACE=2``).
Each window of ``--windows`` is a whole run (the settings were tuned on window 1000; a
held-out window such as 6000 checks that the comparison carries over). Phases, one after
another, each server alone on the machine:

1. Offline engines (:mod:`bench.toolkit.offline` in each venv, both loaded together):
   output tok/s on 32 trace requests at once, decode ms per step at 1 and 8 sequences,
   prefill tok/s, in ``--offline-rounds`` rounds that alternate the engines (each row the
   median). Each engine then stays loaded, idle, for the paired probes of phase 2.
2. Served, one system at a time: the per-token cost of 1 and 8 streams (steady-state
   gap between streamed tokens), each in ``--probe-rounds`` adjacent pairs with the same
   decode on the same engine offline, so the serving overhead compares measurements
   seconds apart rather than minutes (this host's speed drifts by more than the 5% bar
   between phases); then an open-loop replay (:mod:`bench.toolkit.serve_bench`) of a
   conversation-trace window at each ``--rates`` value, and past the top one while the
   system still meets 90% (``--extend-rates``): SLO attainment, goodput, TTFT,
   TPOT. Systems: ``iterserve`` (``iterserve serve`` with its defaults plus the
   benchmark's SLOs declared as its classes' SLOs), ``iterserve-static`` (the same with
   the static-batching policy) and ``vllm`` (its defaults); with ``--base-tree``,
   ``iterserve-base`` is ``iterserve`` served from another checkout (the same venv, that
   tree first on ``PYTHONPATH``), so that a change is judged before and after in one run.
3. Class mix: 70% interactive / 30% batch by header (``x-iterserve-class``) and by vLLM's
   ``priority`` field (vLLM started with ``--scheduling-policy priority``), at
   ``--mix-rates``, extended while vLLM meets 90% on interactive requests, then 1.5x
   that limit; iterserve replays the rates vLLM ran: interactive attainment and batch
   output tok/s per system.

While each served phase runs, the CPU seconds of every process are counted
(``/proc``), to show where the machine's time goes. Output: ``bench/results/peers.json``
(``{"windows": [report, ...]}``, each report with its run record), ``peers.md`` (one
section per window) and ``peers_window<N>.png``. The trace is the Azure LLM inference
trace 2023 (Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit import serve_bench as sb
from bench.toolkit import servers as ps

# The report: markdown tables, targets and one figure.
OFFLINE_ROWS = (
    ("trace32_output_tok_s", "offline, 32 trace requests at once (output tok/s)", True),
    ("stream1_ms_per_step", "offline, one stream (ms per step)", False),
    ("stream8_ms_per_step", "offline, 8 streams (ms per step)", False),
    ("prefill_16x128_tok_s", "offline prefill 16x128 (tok/s)", True),
    ("prefill_8x512_tok_s", "offline prefill 8x512 (tok/s)", True),
    ("prefill_32x64_tok_s", "offline prefill 32x64 (tok/s)", True),
)
TARGETS = {
    "goodput_ratio": 1.2,
    "overhead": 0.05,
    "interactive_attainment": 0.99,
    "batch_tput_ratio": 0.8,
    "offline_ratio": 1.0,
}


_f = functools.partial(rp.fmt, missing="-")
_pct = functools.partial(rp.pct, missing="-")


def offline_section(off: dict) -> tuple[list[str], list[dict]]:
    """Rows vLLM | iterserve | speed ratio (iterserve / vLLM; >1 is faster): the medians
    of the alternating rounds, and the median of the rounds' ratios. A run without vLLM
    (a before/after run) has only iterserve's rows."""
    if "vllm" not in off:
        rows = off["iterserve"]["median"]
        lines = ["## Offline engine", "", "| | iterserve |", "|---|---:|"]
        lines += [f"| {name} | {rows[key]:.1f} |" for key, name, _ in OFFLINE_ROWS]
        return lines + [""], []
    n = len(off["vllm"]["rounds"])
    lines = [
        "## Offline engines",
        "",
        f"Both engines loaded together and measured in {n} alternating rounds; each "
        "figure is the median over the rounds, the ratio the median of the rounds' "
        "ratios.",
        "",
        "| | vLLM CPU | iterserve | iterserve speed / vLLM |",
        "|---|---:|---:|---:|",
    ]
    targets = []
    for key, name, higher_better in OFFLINE_ROWS:
        v, i = off["vllm"]["median"][key], off["iterserve"]["median"][key]
        pairs = zip(off["iterserve"]["rounds"], off["vllm"]["rounds"])
        ratio = statistics.median(
            a[key] / b[key] if higher_better else b[key] / a[key] for a, b in pairs
        )
        lines.append(f"| {name} | {v:.1f} | {i:.1f} | {ratio:.2f}x |")
        targets.append(
            {
                "target": f"{name}: iterserve / vLLM",
                "value": f"{ratio:.2f}x",
                "bar": ">= 1.0x",
                "met": ratio >= TARGETS["offline_ratio"],
            }
        )
    return lines + [""], targets


def token_cost_section(report: dict) -> tuple[list[str], list[dict]]:
    """Served ms per token against the same engine offline, measured in adjacent pairs."""
    lines = [
        "## Served cost per token",
        "",
        "Steady-state gap between streamed tokens (median of the rounds), and the same "
        "decode (prompt, length, streams) on the same engine offline, loaded beside the "
        "server and measured right before or after each served probe. Overhead: the "
        "median of the pairs' served / offline ratios, minus one.",
        "",
        "| system | 1 stream: served / offline (ms) | overhead | "
        "8 streams: served / offline (ms) | overhead |",
        "|---|---:|---:|---:|---:|",
    ]
    targets = []
    for name, res in report["served"].items():
        cells = []
        for n in (1, 8):
            cost = res["token_cost"][str(n)]
            over = cost.get("overhead")
            cells += [
                f"{cost['ms_per_token']:.1f} / {_f(cost.get('offline_ms_per_step'), '.1f')}",
                _pct(over),
            ]
            if name == "iterserve" and over is not None:
                targets.append(
                    {
                        "target": f"iterserve serving overhead per token, {n} stream(s)",
                        "value": _pct(over),
                        "bar": "<= 5%",
                        "met": over <= TARGETS["overhead"],
                    }
                )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    client = {
        name: [res["token_cost"][str(n)].get("client_cores") for n in (1, 8)]
        for name, res in report["served"].items()
    }
    if all(None not in v for v in client.values()):
        shares = ", ".join(
            f"{k} {100 * a:.1f}% / {100 * b:.1f}% of a core" for k, (a, b) in client.items()
        )
        lines += [
            "",
            "The load generator's own CPU while it read the served probes' streams "
            f"(it shares the server's cores), 1 / 8 streams: {shares}.",
        ]
    idle = report.get("offline_idle_cpu_s")
    if idle:
        lines += [
            "",
            "CPU seconds the loaded offline engines used outside their own measurements "
            "(while the servers ran): " + ", ".join(f"{k} {v:.1f}" for k, v in idle.items()) + ".",
        ]
    return lines + [""], targets


def sweep_section(report: dict) -> tuple[list[str], list[dict]]:
    """Per rate and system: attainment, throughput, latency percentiles, refusals."""
    lines = [
        "## Served trace replay (one class)",
        "",
        "| system | rate (req/s) | attainment | out tok/s | TTFT p50 / p99 (s) | "
        "TPOT p50 / p99 (s) | refused | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    good = {}
    for name, res in report["served"].items():
        rep = res["replay"]
        good[name] = rep["goodput"]["overall"]
        for s in rep["summaries"]:
            mark = " *" if s["meets_target"] else ""
            lines.append(
                f"| {name} | {s['rate']:g} | {_pct(s['attainment'])}{mark} | "
                f"{s['output_tokens_per_s']:.1f} | {_f(s['ttft_s']['p50'])} / "
                f"{_f(s['ttft_s']['p99'])} | {_f(s['tpot_s']['p50'], '.3f')} / "
                f"{_f(s['tpot_s']['p99'], '.3f')} | {s['refused']} | {s['failed']} |"
            )
    lines += [
        "",
        "`*`: at least 90% of requests met both SLOs. Goodput (highest such rate): "
        + ", ".join(f"{k} {_f(v, 'g')} req/s" for k, v in good.items()),
        "",
    ]
    targets = []
    if "vllm" in good and "iterserve" in good:
        v, i = good["vllm"], good["iterserve"]
        ratio = (i or 0) / v if v else None
        targets.append(
            {
                "target": "served goodput, iterserve / vLLM",
                "value": f"{i} / {v} req/s" + (f" = {ratio:.2f}x" if ratio is not None else ""),
                # The rates are rounded to 3 decimals after scaling by k, so the
                # ratio of two grid rates is off its nominal value by up to ~5e-4.
                "bar": ">= 1.2x",
                "met": ratio is not None and ratio >= 1.2 - 1e-3,
            }
        )
    return lines, targets


def _mix_rows(rep: dict) -> dict[float, dict]:
    return {s["rate"]: s for s in rep["summaries"]}


def mixed_section(report: dict) -> tuple[list[str], list[dict]]:
    """Class mix: interactive attainment and batch tok/s; targets at vLLM's rate and 1.5x."""
    mixed = report.get("mixed", {})
    if not {"vllm", "iterserve"} <= set(mixed):
        return [], []
    v, i = _mix_rows(mixed["vllm"]["replay"]), _mix_rows(mixed["iterserve"]["replay"])
    lines = [
        "## Class mix: 70% interactive, 30% batch",
        "",
        "| rate (req/s) | vLLM interactive | iterserve interactive | vLLM batch tok/s | "
        "iterserve batch tok/s | iterserve refused |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for rate in sorted(v):
        vi, ii = v[rate]["per_class"], i.get(rate, {}).get("per_class", {})
        lines.append(
            f"| {rate:g} | {_pct(vi['interactive']['attainment'])} | "
            f"{_pct(ii.get('interactive', {}).get('attainment'))} | "
            f"{vi['batch']['output_tokens_per_s']:.1f} | "
            f"{_f(ii.get('batch', {}).get('output_tokens_per_s'), '.1f')} | "
            f"{i.get(rate, {}).get('refused', '-')} |"
        )
    ok = [r for r in sorted(v) if v[r]["per_class"]["interactive"]["attainment"] >= 0.9]
    targets = []
    if ok:
        r0 = ok[-1]
        # Judged at vLLM's limit and at 1.5x it: the first rate run at or above (rates carry
        # 3 decimals, so 1.5x the limit may be 0.001 off the rate that was run).
        later = [r for r in sorted(v) if r >= 1.5 * r0 - 5e-4]
        for rate in [r0] + later[:1]:
            if rate not in i:
                continue
            att = i[rate]["per_class"]["interactive"]["attainment"]
            vb = v[rate]["per_class"]["batch"]["output_tokens_per_s"]
            ib = i[rate]["per_class"]["batch"]["output_tokens_per_s"]
            targets.append(
                {
                    "target": f"mix at {rate:g} req/s: iterserve interactive attainment",
                    "value": _pct(att),
                    "bar": ">= 99%",
                    "met": att >= 0.99,
                }
            )
            ratio = ib / vb if vb else None
            targets.append(
                {
                    "target": f"mix at {rate:g} req/s: batch tok/s, iterserve / vLLM",
                    "value": _f(ratio) + "x",
                    "bar": ">= 0.8x",
                    "met": ratio is not None and ratio >= 0.8,
                }
            )
    lines += [
        "",
        f"Highest rate where vLLM met 90% interactive attainment: "
        f"{ok[-1] if ok else 'none'} req/s; the targets are judged there and at the "
        "first rate run at or above 1.5x it.",
        "",
    ]
    return lines, targets


def cpu_section(report: dict) -> list[str]:
    lines = ["## Where the machine's CPU went during each replay (cores busy)", ""]
    for phase in ("served", "mixed"):
        for name, res in report.get(phase, {}).items():
            shares = ", ".join(f"{g} {c:.2f}" for g, c in res["cpu_share"].items() if c >= 0.01)
            lines.append(f"- {phase} {name}: {shares}")
    return lines + [""]


def host_factor_lines(report: dict) -> list[str]:
    """What the SLOs and rates were scaled by (``peers.host_factor``), and to what."""
    a, f = report["args"], report.get("host_factor", {"k": 1.0, "source": "-"})
    sc = report.get("scaled", {"slo_ttft_s": a["slo_ttft_s"], "slo_tpot_s": a["slo_tpot_s"]})
    why = f["source"]
    if "vllm_stream1_ms" in f:
        why = (
            f"vLLM's offline one-stream decode took {f['vllm_stream1_ms']:.1f} ms per "
            f"token against the {f['reference_ms']} ms the SLOs and rates were set for"
        )
    return [
        f"Host factor k = {f['k']:.2f} ({why}): SLO TTFT <= {a['slo_ttft_s']:g} s x k = "
        f"{sc['slo_ttft_s']:.2f} s, TPOT <= {a['slo_tpot_s']:g} s x k = "
        f"{sc['slo_tpot_s']:.3f} s; nominal rates / k. Rates below are the offered "
        "rates after scaling."
    ]


def markdown(report: dict) -> str:
    """The whole report as markdown."""
    m, a = report["machine"], report["args"]
    head = [
        f"# iterserve vs vLLM CPU, served side by side (commit {m['commit']})",
        "",
        f"{m['cores']} cores ({m['cpu']}), torch {m['torch']}, Ray {m['ray']}, vllm-cpu "
        f"{m['vllm_cpu']}; model {report['model_dir']} (fp32). Trace "
        f"{Path(a['trace']).name} rows {a['window_start']}+{a['num_requests']}, lengths "
        f"/{a['length_scale']:g}; run took {report['wall_s'] / 60:.1f} min. "
        f"{report['trace_attribution']}",
        "",
        *host_factor_lines(report),
        "",
    ]
    body = [line for section in _sections(report) for line in section[0]]
    tbl = ["## Targets", "", *targets_table(report)]
    return "\n".join(head + tbl + [""] + body + cpu_section(report))


def _sections(report: dict) -> list[tuple[list[str], list[dict]]]:
    """Each section's (markdown lines, targets), in the report's order."""
    return [
        (offline_section(report["offline"]) if "offline" in report else ([], [])),
        token_cost_section(report),
        sweep_section(report),
        mixed_section(report),
    ]


def targets_table(report: dict) -> list[str]:
    """Every target of one window's report beside its measurement, as a markdown table."""
    return targets_lines([t for section in _sections(report) for t in section[1]])


def plot(report: dict, path: Path) -> None:
    """Attainment against offered rate, one line per system (single class and mix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in report["served"].items():
        ss = res["replay"]["summaries"]
        axes[0].plot([s["rate"] for s in ss], [s["attainment"] for s in ss], "o-", label=name)
    for name, res in report.get("mixed", {}).items():
        ss = res["replay"]["summaries"]
        axes[1].plot(
            [s["rate"] for s in ss],
            [s["per_class"]["interactive"]["attainment"] for s in ss],
            "o-",
            label=name,
        )
    for ax, title in zip(axes, ("one class: SLO attainment", "mix: interactive attainment")):
        ax.axhline(0.9, color="gray", ls=":")
        ax.set(xlabel="offered rate (req/s)", ylabel="attainment", title=title, ylim=(0, 1.05))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# The phases and the command line.
REFERENCE_STREAM1_MS = 38.2
"""vLLM's offline one-stream decode (ms per token) on the 2-core host that the SLOs and rates
were chosen on: the host speed they were chosen for."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser("bench.peers", __doc__)
    cli.add_quick(p, "tiny smoke run of every phase")
    cli.add_trace(p)
    p.add_argument(
        "--windows",
        default="1000",
        help="first trace rows of the replay windows, one whole run each (the settings "
        "were tuned on 1000; a held-out window, e.g. 1000,6000, checks that the result "
        "carries over)",
    )
    # 50 requests a rate keep a window's run near half an hour. Goodput is read off this
    # grid, so its steps are at most 1.33x up to 3 (a 1.5 -> 3 step cannot tell 1.0x from
    # 1.9x); 1.15 at the bottom and 3.75 at the top keep both systems' limits inside it on
    # the reference host, and rates far past every limit only cost time.
    p.add_argument("--num-requests", type=int, default=50, help="requests per rate")
    p.add_argument(
        "--rates",
        type=cli.floats,
        default="1.15,1.5,2,2.5,3,3.75",
        help="offered rates (req/s), one class",
    )
    # vLLM's interactive limit and 1.5x it are both on this grid for a limit of 2-3.
    p.add_argument(
        "--mix-rates", type=cli.floats, default="2,2.5,3,3.75,4.5", help="offered rates, class mix"
    )
    # On a faster host the fixed grids can end below both systems' limits: extend them.
    p.add_argument(
        "--extend-rates",
        type=int,
        default=3,
        help="past each grid's top, up to this many more rates (x1.25 each) "
        "while the system still meets 90%%; the mix: vLLM's interactive "
        "class, then 1.5x its limit, and iterserve replays vLLM's rates",
    )
    p.add_argument("--length-scale", type=float, default=8.0)
    cli.add_slos(p, 2.0, 0.25)
    p.add_argument(
        "--max-rate-s",
        type=float,
        default=60.0,
        help="cap on one rate's replay; requests still running then are misses",
    )
    p.add_argument(
        "--host-factor",
        default="auto",
        help="k: SLOs x k, rates / k (a host k times slower than the reference "
        "sees the same relative load and SLO tightness). auto: vLLM's "
        f"offline one-stream ms/token / {REFERENCE_STREAM1_MS}, at least 1 "
        "(1 with --skip-offline)",
    )
    p.add_argument(
        "--systems",
        type=cli.names,
        default="vllm,iterserve,iterserve-static",
        help="also: iterserve-ray (the one replica on Ray Serve, --address "
        "local), iterserve-before (the serving defaults before the benchmark's levers), "
        "iterserve-base (with --base-tree)",
    )
    p.add_argument(
        "--base-tree",
        default=None,
        metavar="PATH",
        help="another checkout of iterserve (e.g. a git worktree of an earlier commit), "
        "served as the system iterserve-base with this venv",
    )
    p.add_argument(
        "--offline-rounds",
        type=int,
        default=3,
        help="rounds of the offline measurements, alternating the engines; each row is the median",
    )
    p.add_argument(
        "--probe-rounds",
        type=int,
        default=3,
        help="adjacent pairs of served and offline decode probes per system and "
        "stream count; the overhead is their median ratio",
    )
    p.add_argument(
        "--skip-offline",
        action="store_true",
        help="no offline phase: no offline rows, no overhead, host factor 1",
    )
    p.add_argument("--vllm-venv", default=str(REPO / ".venv-vllm"))
    p.add_argument(
        "--phases",
        type=cli.names,
        default="vllm,llamacpp",
        help="vllm: the windows against vLLM (fp32, the de-quantized directory); llamacpp: "
        "packed weights against llama.cpp and iterserve's fp32 path on the GGUF "
        "(bench.peers_packed). A phase left out keeps its last result in the report",
    )
    p.add_argument(
        "--packed-rounds",
        type=int,
        default=3,
        help="llamacpp phase: rounds of its measures, alternating the systems' order",
    )
    p.add_argument(
        "--packed-extend-rates",
        type=int,
        default=5,
        help="llamacpp phase: rates past the grid's top (x1.25 each) while a system passes",
    )
    cli.add_out(p, str(RESULTS / "peers"), "stem of .md/.json/.png")
    return _checked(p, p.parse_args(argv))


def _checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` validated, with ``--quick``'s sizes and the lists split."""
    if args.host_factor != "auto":
        try:
            if float(args.host_factor) <= 0:
                raise ValueError
        except ValueError:
            p.error(f"--host-factor {args.host_factor!r}: 'auto' or a number > 0")
    if args.quick:
        args.num_requests, args.rates, args.mix_rates = 8, [2.0], [2.0]
        args.extend_rates, args.probe_rounds, args.offline_rounds = 0, 2, 2
        args.packed_rounds, args.packed_extend_rates = 2, 0
        args.out = str(RESULTS / "peers_quick")
    if not args.phases or set(args.phases) - {"vllm", "llamacpp"}:
        p.error(f"--phases {','.join(args.phases)}: vllm, llamacpp or both")
    args.windows = [int(x) for x in args.windows.split(",")]
    if args.quick:
        args.windows = args.windows[:1]
    args.window_start = args.windows[0]
    if args.base_tree:
        args.base_tree = str(Path(args.base_tree).resolve())
        if not (Path(args.base_tree) / "deploy" / "cli.py").is_file():
            p.error(f"--base-tree {args.base_tree}: not an iterserve checkout (no deploy/cli.py)")
    known = [*ps.SYSTEMS, *(["iterserve-base"] if args.base_tree else [])]
    unknown = [s for s in args.systems if s not in known]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return args


def expected_s(
    args: argparse.Namespace, k: float = 1.0, offline: bool = True, extend: bool = False
) -> float:
    """Rough wall time at host factor ``k``: server starts, probes, replays (each rate at
    most its cap); ``offline``: with the offline phase still to run; ``extend``: as if
    every grid ran all its extensions (they run only where a system passes the grid's
    top). The allowances are a full run's phase times at k = 1: each replay took N/R plus a
    few seconds, and the offline phase, the server starts and the probes the rest."""
    cap = args.max_rate_s * k + 10

    def sweep(rates: list[float], more: int) -> float:
        rates = rates + [rates[-1] * 1.25**j for j in range(1, more * extend + 1)]
        return sum(min(args.num_requests * k / r + 4, cap) for r in rates)

    per_rate = sweep(args.rates, args.extend_rates)
    per_mix = sweep(args.mix_rates, args.extend_rates + 1)
    # Loading both engines, then a measuring pass of about 26 s per engine (twice that
    # with the first round's warm-ups).
    rounds = args.offline_rounds + 1
    offline = 0 if args.skip_offline or not offline else 90 + 55 * rounds
    starts = 45 * (len(args.systems) + 1)
    # About 17 s a probe round: 1 and 8 streams of 96 tokens, served and offline.
    served = len(args.systems) * (per_rate + 40 + 12 * args.probe_rounds)
    mixed = 2 * per_mix
    return offline + starts + served + mixed


def start_offline(
    args: argparse.Namespace, model_dir: str, stack: contextlib.ExitStack
) -> tuple[dict, dict]:
    """The offline engines of ``--systems``' kinds (:mod:`bench.toolkit.offline`, each in its
    venv), loaded together and measured in ``--offline-rounds`` alternating rounds (vLLM
    first in even rounds, iterserve first in odd ones; the first round with a warm-up call
    per measurement);
    each then stays loaded, idle, for the served phases' paired probes until ``stack``
    closes. Returns ({engine: {"median": {...}, "rounds": [...]}}, {engine:
    :class:`ps.OfflineEngine`})."""
    engines = {}
    kinds = {system(args, name).kind for name in args.systems}
    for name, py in (
        ("vllm", Path(args.vllm_venv) / "bin/python"),
        ("iterserve", REPO / ".venv/bin/python"),
    ):
        if name not in kinds:  # a before/after run without vLLM needs no vLLM venv
            continue
        cmd = [
            "--model",
            model_dir,
            "--trace",
            args.trace,
            "--repeats",
            "1",
            "--decode-tokens",
            "16" if args.quick else "48",
        ]
        print(f"[peers] loading offline {name}", flush=True)
        engines[name] = stack.enter_context(ps.OfflineEngine(name, py, cmd))
        engines[name].start()
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.offline_rounds):
        print(f"[peers] offline round {r + 1} of {args.offline_rounds}", flush=True)
        for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
            rounds[name].append(engines[name].measure(warmup=r == 0))
    results = {
        name: {
            "median": {k: statistics.median(m[k] for m in runs) for k in runs[0]},
            "rounds": runs,
        }
        for name, runs in rounds.items()
    }
    return results, engines


def host_factor(args: argparse.Namespace, offline: dict | None) -> dict:
    """The host factor ``k`` (see ``--host-factor``) and what it was derived from.

    The SLOs and rates are absolute, and a shared machine's speed drifts several-fold
    between days: on a slow day every system misses every SLO at every rate, and the run
    ranks nothing. Scaling SLOs up and rates down by the same measured ``k`` keeps the
    load and the SLOs' tightness what they were relative to the host; both systems get
    the same scaled values, so the ratios between them keep their meaning.
    """
    if args.host_factor != "auto":
        return {"k": float(args.host_factor), "source": "--host-factor"}
    measured = (offline or {}).get("vllm", {}).get("median", {}).get("stream1_ms_per_step")
    if measured is None:
        return {"k": 1.0, "source": "no offline vLLM measurement (--skip-offline)"}
    return {
        "k": max(1.0, measured / REFERENCE_STREAM1_MS),
        "vllm_stream1_ms": measured,
        "reference_ms": REFERENCE_STREAM1_MS,
        "source": "vLLM offline one-stream ms/token / reference, at least 1",
    }


def system(args: argparse.Namespace, name: str) -> ps.SystemSpec:
    """The served system ``name``: one of :data:`ps.SYSTEMS`, or ``iterserve-base``
    (``iterserve`` from ``--base-tree``, that tree first on ``PYTHONPATH``)."""
    if name == "iterserve-base":
        return ps.SystemSpec("iterserve-base", "iterserve", env={"PYTHONPATH": args.base_tree})
    return ps.SYSTEMS[name]


def scaled(args: argparse.Namespace, k: float) -> argparse.Namespace:
    """``args`` with SLOs and the per-rate cap times ``k``, rates divided by ``k``."""
    return argparse.Namespace(
        **{
            **vars(args),
            "slo_ttft_s": args.slo_ttft_s * k,
            "slo_tpot_s": args.slo_tpot_s * k,
            "max_rate_s": args.max_rate_s * k,
            "rates": [round(r / k, 3) for r in args.rates],
            "mix_rates": [round(r / k, 3) for r in args.mix_rates],
        }
    )


def bench_config(
    args: argparse.Namespace, server: ps.Server, rates: list[float], mix: bool, extend: bool
) -> sb.BenchConfig:
    """``extend``: the grid goes on past ``rates`` (``--extend-rates``); for the mix, by
    the interactive class, then one rate at 1.5x its limit (the mix targets' two rates)."""
    more = {"extend_rates": args.extend_rates} if extend else {}
    if extend and mix:
        more |= {"extend_class": "interactive", "limit_factor": 1.5}
    return sb.BenchConfig(
        base_url=server.url,
        model=server.model_name,
        tokenizer=server.model_dir,
        trace=args.trace,
        window_start=args.window_start,
        num_requests=args.num_requests,
        rates=rates,
        length_scale=args.length_scale,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        max_duration_s=args.max_rate_s,
        label=server.label,
        class_mix={"interactive": 0.7, "batch": 0.3} if mix else None,
        priority_field=mix and server.kind == "vllm",
        warmup=2,
        extra_headers={"Authorization": f"Bearer {ps.MIX_API_KEY}"} if mix else {},
        **more,
    )


async def served_phase(
    args: argparse.Namespace,
    server: ps.Server,
    mix: bool,
    rates: list[float] | None,
    offline: ps.OfflineEngine | None,
) -> dict:
    """Token-cost probes (single-class runs only; paired with ``offline``, the same engine
    offline, where given) and the replay, with CPU accounting.
    ``rates``: replay exactly these; None: the grid of ``args``, extended."""
    out: dict = {"label": server.label, "command": server.command, "env": server.spec.env}
    if not mix:
        tokens = 8 if args.quick else 96
        out["token_cost"] = {
            str(n): await (
                ps.paired_token_cost(server, offline, n, tokens, args.probe_rounds)
                if offline
                else ps.token_cost(server, n, tokens)
            )
            for n in (1, 8)
        }
    grid = rates or (args.mix_rates if mix else args.rates)
    before = ps.cpu_seconds()
    t0 = time.monotonic()
    report = await sb.run(bench_config(args, server, grid, mix, extend=rates is None))
    out["cpu_share"] = ps.cpu_share(before, ps.cpu_seconds(), time.monotonic() - t0)
    out["replay"] = report
    return out


def run_system(
    args: argparse.Namespace,
    spec: ps.SystemSpec,
    model_dir: str,
    mix: bool,
    rates: list[float] | None = None,
    offline: ps.OfflineEngine | None = None,
) -> dict:
    with ps.Server(spec, model_dir, mix=mix, slo=(args.slo_ttft_s, args.slo_tpot_s)) as server:
        return asyncio.run(served_phase(args, server, mix, rates, offline))


def run_mix(args: argparse.Namespace, model_dir: str) -> dict:
    """The class mix: vLLM first, on the extended grid; iterserve on the rates vLLM ran."""
    out: dict = {}
    rates = None
    for name in [n for n in ("vllm", "iterserve") if n in args.systems]:
        out[name] = run_system(
            args, replace(system(args, name), priority=True), model_dir, mix=True, rates=rates
        )
        if name == "vllm":
            rates = [s["rate"] for s in out[name]["replay"]["summaries"]]
    return out


def run_phases(args: argparse.Namespace, report: dict, model_dir: str, engines: dict) -> None:
    """The served phases, at the host factor measured offline; results into ``report``."""
    report["host_factor"] = factor = host_factor(args, report.get("offline"))
    nominal, args = args, scaled(args, factor["k"])
    report["scaled"] = {
        k: getattr(args, k)
        for k in ("slo_ttft_s", "slo_tpot_s", "rates", "mix_rates", "max_rate_s")
    }
    print(
        f"[peers] host factor {factor['k']:.2f}: SLO TTFT <= {args.slo_ttft_s:.2f} s, "
        f"TPOT <= {args.slo_tpot_s:.3f} s, rates {args.rates}, mix {args.mix_rates}; "
        f"~{expected_s(nominal, factor['k'], offline=False) / 60:.0f} min to go",
        flush=True,
    )
    report["served"] = {
        name: run_system(
            args,
            system(args, name),
            model_dir,
            mix=False,
            offline=engines.get(system(args, name).kind),
        )
        for name in args.systems
    }
    report["mixed"] = run_mix(args, model_dir)


def run_window(args: argparse.Namespace, model_dir: str) -> dict:
    """One whole run on the window at ``args.window_start``: the offline engines, the served
    systems, the class mix; the report of that window."""
    t0 = time.monotonic()
    report: dict = {
        "args": {k: v for k, v in vars(args).items()},
        "machine": ps.machine_info(),
        "model_dir": model_dir,
        "trace_attribution": sb.ATTRIBUTION,
    }
    with contextlib.ExitStack() as stack:
        engines = {}
        if not args.skip_offline:
            report["offline"], engines = start_offline(args, model_dir, stack)
        at_start = {name: (e.cpu_s(), e.probe_cpu_s) for name, e in engines.items()}
        run_phases(args, report, model_dir, engines)
        # The loaded offline engines must stay idle while the servers are measured.
        report["offline_idle_cpu_s"] = {
            name: e.cpu_s() - at_start[name][0] - (e.probe_cpu_s - at_start[name][1])
            for name, e in engines.items()
        }
    report["wall_s"] = time.monotonic() - t0
    report["run"] = rp.run_record()
    return report


def main(argv: list[str] | None = None) -> int:
    from bench import peers_packed

    args = parse_args(argv)
    n = len(args.windows) if "vllm" in args.phases else 0
    packed_s = peers_packed.expected_s(args) if "llamacpp" in args.phases else 0
    most = n * expected_s(args, extend=True) + packed_s
    slow = n * expected_s(args, 2.5) + 2.5 * packed_s
    cli.expected(
        "peers",
        n * expected_s(args) + packed_s,
        f"at host factor 1, {n} window{'s' * (n != 1)} against vLLM; at most ~{most / 60:.0f} "
        f"min if every grid extends; ~{slow / 60:.0f} min at host factor 2.5; printed again "
        "once measured",
    )
    t0 = time.monotonic()
    model_dir = ps.model_dir()
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    old = (
        json.loads(stem.with_suffix(".json").read_text())
        if stem.with_suffix(".json").is_file()
        else {}
    )
    result = {"windows": old.get("windows", []), "llamacpp": old.get("llamacpp")}
    if "vllm" in args.phases:
        result["windows"] = []
        for window in args.windows:
            args.window_start = window
            result["windows"].append(run_window(args, model_dir))
            # Written after each window, so that a later window's failure keeps the earlier.
            rp.write_json(result, stem.with_suffix(".json"), compact=True)
            plot(result["windows"][-1], stem.parent / f"{stem.name}_window{window}.png")
    if "llamacpp" in args.phases:
        ran = result["windows"] if "vllm" in args.phases else []
        k = ran[0]["host_factor"] if ran else host_factor(args, None)
        packed_args = scaled(args, k["k"])
        packed_args.window_start = args.windows[0]
        result["llamacpp"] = peers_packed.run(packed_args)
        result["llamacpp"]["host_factor"] = k
        result["llamacpp"]["args"] = {
            key: getattr(packed_args, key)
            for key in (
                "slo_ttft_s",
                "slo_tpot_s",
                "rates",
                "num_requests",
                "window_start",
                "length_scale",
                "packed_rounds",
                "packed_extend_rates",
            )
        }
        rp.write_json(result, stem.with_suffix(".json"), compact=True)
    # Each window's report and the packed phase's hold their own run record.
    md = full_markdown(result)
    rp.write_report(stem.with_suffix(".json"), result, md, compact=True, record_run=False)
    print(f"[peers] done in {(time.monotonic() - t0) / 60:.1f} min")
    return 0


def full_markdown(result: dict) -> str:
    """Every window's report against vLLM, then the packed-weights phase's."""
    from bench import peers_packed

    parts = [markdown(r) for r in result.get("windows", [])]
    packed = result.get("llamacpp")
    if packed:
        lines, targets = peers_packed.section(packed)
        parts.append("\n".join(packed_header(packed) + targets_lines(targets) + [""] + lines))
    return "\n\n".join(parts)


def packed_header(packed: dict) -> list[str]:
    run, a, k = packed["run"], packed["args"], packed["host_factor"]
    return [
        f"# iterserve vs llama.cpp on the GGUF, served side by side (commit {run['commit']})",
        "",
        f"{run['date']}, {run['host']}: `{run['command']}`; took {packed['wall_s'] / 60:.1f} "
        f"min. Host factor k = {k['k']:.2f} ({k['source']}): SLO TTFT <= {a['slo_ttft_s']:.2f} "
        f"s, TPOT <= {a['slo_tpot_s']:.3f} s; trace rows {a['window_start']}+"
        f"{a['num_requests']}, lengths /{a['length_scale']:g}.",
        "",
        "## Targets",
        "",
    ]


def targets_lines(targets: list[dict]) -> list[str]:
    """Targets beside their measurements, as a markdown table."""
    return ["| target | measured | bar | met |", "|---|---|---|---|"] + [
        f"| {t['target']} | {t['value']} | {t['bar']} | {'yes' if t['met'] else 'no'} |"
        for t in targets
    ]


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
