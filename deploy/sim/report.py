"""What a simulated run reports: per class latency, SLO attainment, goodput; tables; plots.

A request meets its SLOs when its TTFT (arrival at the ingress to first token) and its
TPOT (mean seconds per output token after the first) are both within its class's; a
refused or rejected request is a miss. Goodput over a sweep of rates is DistServe's (Zhong
et al., OSDI 2024): the highest offered rate at which at least :data:`ATTAINMENT` of
requests, in every class, meet their SLOs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deploy.sim.fleet import Outcome, SimRun, meets
from policies import TrafficClass

ATTAINMENT = 0.9


def _pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def class_summary(outcomes: list[Outcome], cls: TrafficClass, span_s: float) -> dict[str, Any]:
    """One class's figures; times in seconds, rates per second of the offered span."""
    ok = [o for o in outcomes if o.status == "ok"]
    met = sum(meets(o, cls) for o in outcomes)
    ttft = [o.ttft_s for o in ok]
    tpot = [o.tpot_s for o in ok if o.request.output_tokens > 1]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "refused": sum(o.status == "refused" for o in outcomes),
        "rejected": sum(o.status == "rejected" for o in outcomes),
        "ttft_slo_s": cls.ttft_slo_s,
        "tpot_slo_s": cls.tpot_slo_s,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_mean_s": sum(tpot) / len(tpot) if tpot else None,
        "tpot_p50_s": _pct(tpot, 0.5),
        "tpot_p99_s": _pct(tpot, 0.99),
        "attainment": met / len(outcomes) if outcomes else None,
        "goodput_rps": met / span_s if span_s > 0 else None,
        "output_tokens_per_s": sum(o.request.output_tokens for o in ok) / span_s
        if span_s > 0
        else None,
    }


def summarize(run: SimRun, classes: Mapping[str, TrafficClass]) -> dict[str, Any]:
    """The run's report: per class, over all requests, and per replica."""
    outcomes = run.outcomes
    span = max((o.request.arrival_s for o in outcomes), default=0.0)
    span = span * len(outcomes) / max(1, len(outcomes) - 1) if span else 1.0
    by_class: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_class.setdefault(o.request.traffic_class, []).append(o)
    per_class = {
        name: class_summary(os_, classes[name], span) for name, os_ in sorted(by_class.items())
    }
    met = sum(meets(o, classes[o.request.traffic_class]) for o in outcomes)
    usage = [s.kv_usage for s in run.timeline]
    return {
        "requests": len(outcomes),
        "offered_rps": len(outcomes) / span,
        "attainment": met / len(outcomes) if outcomes else None,
        "goodput_rps": met / span,
        "classes": per_class,
        "latency": latency(outcomes),
        "preemptions": run.preemptions,
        "steps": run.steps,
        "end_s": run.end_s,
        "replica_busy": [b / run.end_s if run.end_s else 0.0 for b in run.busy_s],
        "kv_usage_p50": _pct(usage, 0.5),
        "kv_usage_max": max(usage, default=None),
    }


def latency(outcomes: list[Outcome]) -> dict[str, float | None]:
    """TTFT and TPOT mean and p99 (s) over every class's finished requests."""
    ok = [o for o in outcomes if o.status == "ok"]
    ttft = [o.ttft_s for o in ok]
    tpot = [o.tpot_s for o in ok if o.request.output_tokens > 1]
    return {
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_mean_s": sum(tpot) / len(tpot) if tpot else None,
        "tpot_p99_s": _pct(tpot, 0.99),
    }


def all_classes_meet(summary: Mapping[str, Any], attainment: float = ATTAINMENT) -> bool:
    return all(c["attainment"] >= attainment for c in summary["classes"].values())


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(summary: Mapping[str, Any]) -> str:
    """A Markdown table, one row per class."""
    lines = [
        "| class | requests | attainment | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) "
        "| refused | goodput (req/s) | out tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in summary["classes"].items():
        lines.append(
            f"| {name} | {c['requests']} | {_f(c['attainment'], '.1%')} | "
            f"{_f(c['ttft_p50_s'], '.3f')} / {_f(c['ttft_p99_s'], '.3f')} | "
            f"{_f(c['tpot_p50_s'], '.4f')} / {_f(c['tpot_p99_s'], '.4f')} | "
            f"{c['refused'] + c['rejected']} | {_f(c['goodput_rps'], '.3f')} | "
            f"{_f(c['output_tokens_per_s'], '.1f')} |"
        )
    busy = summary["replica_busy"]
    lines.append(
        f"\n{summary['requests']} requests at {summary['offered_rps']:.3f} req/s: attainment "
        f"{_f(summary['attainment'], '.1%')}, goodput {summary['goodput_rps']:.3f} req/s; "
        f"{summary['preemptions']} preemptions, {summary['steps']} steps, replicas busy "
        f"{min(busy):.0%}-{max(busy):.0%}, KV usage p50 {_f(summary['kv_usage_p50'], '.0%')} "
        f"max {_f(summary['kv_usage_max'], '.0%')}"
    )
    return "\n".join(lines)


def plot(
    runs: list[tuple[float, SimRun]], summaries: list[dict], out_dir: str | Path
) -> list[Path]:
    """PNGs in ``out_dir``: TTFT and TPOT distributions per class (the first rate), KV
    usage and queue over time (the first rate), attainment against rate (a sweep).

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'iterserve[sim]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plots need matplotlib: pip install 'iterserve[sim]'") from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_plot_latency(plt, runs[0][1], out), _plot_timeline(plt, runs[0][1], out)]
    if len(runs) > 1:
        paths.append(_plot_sweep(plt, runs, summaries, out))
    return paths


def _plot_latency(plt, run: SimRun, out: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    by_class: dict[str, list[Outcome]] = {}
    for o in run.outcomes:
        if o.status == "ok":
            by_class.setdefault(o.request.traffic_class, []).append(o)
    for name, os_ in sorted(by_class.items()):
        for ax, xs in (
            (axes[0], [o.ttft_s for o in os_]),
            (axes[1], [o.tpot_s for o in os_ if o.request.output_tokens > 1]),
        ):
            xs = sorted(xs)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    for ax, what in zip(axes, ("TTFT (s)", "TPOT (s)")):
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.legend()
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_timeline(plt, run: SimRun, out: Path) -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for i in sorted({s.replica for s in run.timeline}):
        pts = [s for s in run.timeline if s.replica == i]
        axes[0].plot([s.t for s in pts], [s.kv_usage for s in pts], lw=0.8, label=f"replica {i}")
        axes[1].plot([s.t for s in pts], [s.running + s.waiting for s in pts], lw=0.8)
    axes[0].set_ylabel("KV usage")
    axes[1].set_ylabel("requests (running + waiting)")
    axes[1].set_xlabel("virtual time (s)")
    if len(axes[0].lines) <= 8:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "replicas_over_time.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_sweep(plt, runs, summaries, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [s["offered_rps"] for s in summaries]
    for name in summaries[0]["classes"]:
        ax.plot(
            rates,
            [s["classes"].get(name, {}).get("attainment") for s in summaries],
            marker="o",
            label=name,
        )
    ax.axhline(ATTAINMENT, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.legend()
    fig.tight_layout()
    path = out / "attainment_vs_rate.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def describe(cost) -> dict[str, Any]:
    """The cost model, for reports."""
    return {"kind": type(cost).__name__, **dataclasses.asdict(cost)}


def writable_file(path: str | Path) -> bool:
    """Whether a file could be written at ``path``: not a directory, in a writable one."""
    path = Path(path)
    return not path.is_dir() and path.parent.is_dir() and os.access(path.parent, os.W_OK)
