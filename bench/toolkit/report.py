"""The report module every benchmark shares: per-request SLO judgement, summaries, goodput,
table formatting, the result files (:func:`write_report`: JSON and markdown), plots and the
run record.

Definitions (vLLM's benchmark's; seconds): TTFT is the scheduled arrival to the first token
(admission holds and generator lag count against it); E2E the arrival to the end of the
stream; TPOT = (E2E - TTFT) / (output tokens - 1), 0 for one-token outputs; ITL the gaps
between successive token arrivals. A request meets its SLOs iff it finished with all its
tokens, TTFT <= the TTFT SLO and TPOT <= the TPOT SLO; refused, failed and cut-off requests
are misses. Goodput (DistServe, Zhong et al., OSDI 2024): the highest offered rate at which
at least 90% of requests meet both SLOs.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.toolkit import REPO

GOODPUT_ATTAINMENT = 0.90

SloOf = Callable[[str | None], tuple[float, float]]
"""A request's class -> (TTFT SLO s, TPOT SLO s)."""


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0-100) by linear interpolation; None when there are no values."""
    xs = sorted(x for x in values if x is not None and not math.isnan(x))
    if not xs:
        return None
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def judge(
    rec: dict[str, Any], ttft_slo_s: float, tpot_slo_s: float, end_s: float | None = None
) -> dict[str, Any]:
    """Add ``ttft_s``, ``tpot_s``, ``e2e_s``, ``ok`` and ``slo_met`` to ``rec``; returns it.

    A cut-off request gets its TTFT so far (``ttft_censored``: a lower bound) and
    ``could_meet``: whether it was still within both SLOs when cut at ``end_s``.
    """
    arrival, first = rec["arrival_s"], rec["first_token_s"]
    n = rec["output_tokens"]
    rec["ok"] = rec["status"] == "finished" and n == rec["output_tokens_expected"]
    rec["ttft_s"] = None if first is None else first - arrival
    rec["e2e_s"] = None if rec["end_s"] is None else rec["end_s"] - arrival
    rec["tpot_s"] = None
    if rec["ok"] and first is not None:
        rec["tpot_s"] = (rec["end_s"] - first) / (n - 1) if n > 1 else 0.0
    rec["slo_met"] = (
        rec["ok"]
        and rec["ttft_s"] is not None
        and rec["ttft_s"] <= ttft_slo_s
        and rec["tpot_s"] <= tpot_slo_s
    )
    rec["ttft_censored"] = rec["status"] == "cut_off" and first is None
    rec["could_meet"] = False
    if rec["status"] == "cut_off":
        cut = rec["end_s"] if rec["end_s"] is not None else end_s
        if first is None:
            rec["ttft_s"] = cut - arrival
            rec["could_meet"] = rec["ttft_s"] <= ttft_slo_s
        else:
            left = rec["output_tokens_expected"] - 1
            floor_tpot = (cut - first) / left if left > 0 else 0.0
            rec["could_meet"] = rec["ttft_s"] <= ttft_slo_s and floor_tpot <= tpot_slo_s
    return rec


def _pcts(values: list[float], ps: tuple[int, ...]) -> dict[str, float | None]:
    return {f"p{p}": percentile(values, p) for p in ps}


def _itls(rec: dict[str, Any]) -> list[float]:
    ts = sorted(set(rec.get("token_s") or []))
    return [b - a for a, b in zip(ts, ts[1:])]


def stats(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Attainment, throughput (per wall second) and latency percentiles (s) of judged records."""
    ok = [r for r in records if r["ok"]]
    lags = [r["lag_s"] for r in records if r["lag_s"] is not None]
    refused = sum(r["status"] == "refused" for r in records)
    met = sum(r["slo_met"] for r in records)
    out_tokens = sum(r["output_tokens"] for r in records)
    wall = max(wall_s, 1e-9)
    held = [r["held_s"] for r in records if r.get("held_s") is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "slo_met": met,
        "attainment": met / max(1, len(records)),
        "attainment_admitted": met / (len(records) - refused) if len(records) > refused else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_s": _pcts([r["ttft_s"] for r in records if r["ttft_s"] is not None], (50, 90, 99)),
        # One-token outputs have TPOT 0 by definition; leaving them out keeps the spread honest.
        "tpot_s": _pcts([r["tpot_s"] for r in ok if r["output_tokens"] > 1], (50, 90, 99)),
        "itl_s": _pcts([x for r in ok for x in _itls(r)], (50, 99)),
        "e2e_s": _pcts([r["e2e_s"] for r in ok], (50, 99)),
        "refused": refused,
        "failed": sum(r["status"] == "error" for r in records),
        "cut_off": sum(r["status"] == "cut_off" for r in records),
        "cut_off_could_meet": sum(r["could_meet"] for r in records),
        "ttft_censored": sum(r["ttft_censored"] for r in records),
        "incomplete": sum(r["status"] == "finished" and not r["ok"] for r in records),
        "held_p50_s": percentile(held, 50),
        "mean_lag_s": sum(lags) / len(lags) if lags else None,
        "max_lag_s": max(lags, default=None),
    }


def summarize(
    records: list[dict[str, Any]],
    rate: float,
    slo_of: SloOf,
    wall_s: float,
    attainment_target: float = GOODPUT_ATTAINMENT,
) -> dict[str, Any]:
    """Judge every record, then one rate's summary: over all, and per class when classed."""
    for r in records:
        judge(r, *slo_of(r["class"]), end_s=wall_s)
    summary = {"rate": rate, "wall_s": wall_s, **stats(records, wall_s)}
    summary["meets_target"] = summary["attainment"] >= attainment_target
    classes = sorted({r["class"] for r in records if r["class"] is not None})
    if classes:
        summary["per_class"] = {
            c: stats([r for r in records if r["class"] == c], wall_s) for c in classes
        }
    return summary


def goodput(
    summaries: list[dict[str, Any]], target: float = GOODPUT_ATTAINMENT, cls: str | None = None
) -> dict[str, Any]:
    """Goodput over one system's rates (req/s).

    ``rps``: the highest offered rate whose attainment (of ``cls``, if given) reaches
    ``target``. ``interpolated``: linear between that rate and the next higher one that
    misses, when they are adjacent in the sweep (a finer reading of a coarse grid).
    ``bound``: ``below_lowest`` (no rate passes), ``at_least_highest`` (all pass) or
    ``bracketed``.
    """

    def att(s: dict[str, Any]) -> float:
        return s["attainment"] if cls is None else s["per_class"][cls]["attainment"]

    pts = sorted(summaries, key=lambda s: s["rate"])
    ok = [s for s in pts if att(s) >= target]
    if not ok:
        return {
            "rps": None,
            "interpolated": None,
            "bound": "below_lowest",
            "lowest_rate": pts[0]["rate"] if pts else None,
        }
    best = max(ok, key=lambda s: s["rate"])
    above = [s for s in pts if s["rate"] > best["rate"]]
    if not above:
        return {"rps": best["rate"], "interpolated": best["rate"], "bound": "at_least_highest"}
    nxt = above[0]
    a0, a1 = att(best), att(nxt)
    frac = (a0 - target) / (a0 - a1) if a0 > a1 else 0.0
    return {
        "rps": best["rate"],
        "bound": "bracketed",
        "bracket": [best["rate"], nxt["rate"]],
        "interpolated": best["rate"] + (nxt["rate"] - best["rate"]) * frac,
    }


def fmt(x: float | None, spec: str = ".2f", missing: str = "—") -> str:
    """``x`` formatted by ``spec``; ``missing`` for None."""
    return missing if x is None else format(x, spec)


def pct(x: float | None, missing: str = "—", digits: int = 0) -> str:
    """A fraction (0-1) as a percentage with ``digits`` decimals; ``missing`` for None."""
    return missing if x is None else f"{x:.{digits}%}"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A markdown table; ``align`` one char per column, ``l`` or ``r`` (default: l, then r)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    return "\n".join("| " + " | ".join(r) + " |" for r in [header, sep, *rows])


def finite(x: Any) -> Any:
    """``x`` with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def compact_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A record for the JSON: times rounded to microseconds, per-token times dropped."""
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in rec.items() if k != "token_s"}


def write_json(report: dict[str, Any], path: str | Path, compact: bool = False) -> None:
    """``report`` as strict JSON: one line (``compact``, for large results), or each
    top-level key indented with a ``records`` list one compact line per record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = finite(report)
    if compact:
        path.write_text(json.dumps(report, separators=(",", ":"), default=str))
        return
    parts = [
        f"{json.dumps(k)}: {json.dumps(v, indent=1, default=str)}"
        for k, v in report.items()
        if k != "records"
    ]
    if "records" in report:
        recs = ",\n".join(json.dumps(r, separators=(",", ":")) for r in report["records"])
        parts.append(f'"records": [\n{recs}\n]')
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n")


def write_report(
    path: str | Path,
    result: dict[str, Any],
    markdown: str | None = None,
    *,
    md_file: bool = True,
    compact: bool = False,
    record_run: bool = True,
) -> Path:
    """A suite's result files: ``result`` as JSON at ``path`` (:func:`write_json`), with
    the run record (:func:`run_record`) added under ``"run"`` where it has none and
    ``record_run``; ``markdown``, where given, printed and (``md_file``) written beside it
    (``path`` with ``.md``). Prints where they went; returns ``path``."""
    path = Path(path)
    if record_run and "run" not in result:
        result = {"run": run_record(), **result}
    write_json(result, path, compact)
    wrote = [str(path)]
    if markdown is not None:
        print(markdown.rstrip("\n"))
        if md_file:
            path.with_suffix(".md").write_text(markdown.rstrip("\n") + "\n")
            wrote.append(path.with_suffix(".md").name)
    print(f"wrote {' and '.join(wrote)}", flush=True)
    return path


def plot_attainment(
    series: dict[str, list[dict[str, Any]]], path: str | Path, *, title: str, cls: str | None = None
) -> str:
    """Attainment and SLO goodput rate against offered rate, one line per system; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, summaries in series.items():
        pts = sorted(summaries, key=lambda s: s["rate"])
        st = [s if cls is None else s["per_class"][cls] for s in pts]
        xs = [s["rate"] for s in pts]
        axes[0].plot(xs, [100 * s["attainment"] for s in st], "o-", label=name)
        axes[1].plot(
            xs,
            [s["slo_met"] / max(1e-9, s["requests"]) * x for s, x in zip(st, xs)],
            "o-",
            label=name,
        )
    axes[0].axhline(100 * GOODPUT_ATTAINMENT, color="gray", ls="--", lw=1)
    axes[0].set_ylabel("SLO attainment (%)")
    axes[1].set_ylabel("requests meeting SLOs per second")
    for ax in axes:
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else :func:`platform.processor`)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
        platform.processor() or platform.machine(),
    )


def host() -> str:
    """This machine in a few words: cores and CPU model (:func:`cpu_model`)."""
    return f"{os.cpu_count()} cores, {cpu_model()}"


def commit() -> str:
    """``git rev-parse --short HEAD`` of the repository; ``"unknown"`` outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
    except OSError:
        out = ""
    return out or "unknown"


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``; None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine a run had: ``cpu_count``, ``platform``, ``python`` (the in-process
    suites' ``"machine"``, beside the versions each adds)."""
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def run_record() -> dict[str, str]:
    """What every result file records about its run, under ``"run"``: ``date`` (UTC, ISO
    8601, when the run finished), ``commit`` (:func:`commit`), ``host`` (:func:`host`) and
    ``command`` (the command line as typed, ``python -m bench.<suite> ...``)."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "host": host(),
        "command": shlex.join(["python", *sys.orig_argv[1:]]),
    }
