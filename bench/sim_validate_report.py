"""The report of ``bench/sim_validate.py``: the targets against the issue's bars, and its
markdown (the fits, the targets, real against simulated, the sensitivity runs and the
rescaled simulation)."""

from __future__ import annotations

from typing import Any

import report as rp

YES = {True: "yes", False: "no"}
BARS = {"mean": 0.05, "p99": 0.10}
"""The issue's bars: mean TTFT and TPOT within 5%, p99 within 10%."""


def goodput(rows: list[dict], key: str) -> float | None:
    """The highest rate (req/s) whose ``key`` attainment is at least 90% (None: none)."""
    return max((r["rate"] for r in rows if r[key] >= rp.GOODPUT_ATTAINMENT), default=None)


def within_bars(row: dict) -> dict[str, bool]:
    """Per statistic in :data:`BARS`: whether both TTFT's and TPOT's errors are within it."""
    return {
        stat: all(abs(row[f"{m}_{stat}"]["error"]) <= BARS[stat] for m in ("ttft", "tpot"))
        for stat in BARS
    }


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """Each rate against the bars (mean TTFT and TPOT errors within ``BARS["mean"]``, p99
    errors within ``BARS["p99"]``), and whether the real mean TTFT and TPOT lie within the
    means the simulation gives at costs x0.95 and x1.05: whether a step-time error of 5%
    or less accounts for the disagreement."""
    out = []
    for r in rows:
        lo, hi = r["sensitivity"]["0.95"], r["sensitivity"]["1.05"]
        out.append(
            {
                "rate": r["rate"],
                "load": r["load"],
                **within_bars(r),
                "band": all(
                    lo[f"{m}_mean"] <= r[f"{m}_mean"]["real"] <= hi[f"{m}_mean"]
                    for m in ("ttft", "tpot")
                ),
            }
        )
    return out


def goodput_within_one_step(rows: list[dict]) -> bool:
    """Real and simulated goodput are the same rate or neighbours in the run's rates."""
    rates = [r["rate"] for r in rows]
    g = [goodput(rows, k) for k in ("attainment_real", "attainment_sim")]
    idx = [rates.index(x) if x is not None else -1 for x in g]
    return abs(idx[0] - idx[1]) <= 1


def targets_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "## Targets",
        "",
        f"| load (x capacity) | rate (req/s) | TTFT and TPOT means within "
        f"{BARS['mean']:.0%} | p99s within {BARS['p99']:.0%} | real means within the "
        "simulation's at costs x0.95-x1.05 |",
        "|---:|---:|---|---|---|",
    ]
    for t in targets(rows):
        load = f"{t['load']:.2f}" if t["load"] is not None else "-"
        lines.append(
            f"| {load} | {t['rate']:g} | {YES[t['mean']]} | {YES[t['p99']]} | {YES[t['band']]} |"
        )
    return lines + ["", f"Goodput within one load step: {YES[goodput_within_one_step(rows)]}.", ""]


def fits_markdown(rows: list[dict]) -> list[str]:
    names = list(rows[0]["fit"]["reference_ms"])
    lines = [
        "| rate (req/s) | steps | held-out MAPE | "
        + " | ".join(f"{n}, predicted ms" for n in names)
        + " |",
        "|---:|---:|---:|" + "---:|" * len(names),
    ]
    for r in rows:
        f = r["fit"]
        lines.append(
            f"| {r['rate']:g} | {f['steps']} | {f['held_out_mape']:.1%} | "
            + " | ".join(f"{f['reference_ms'][n]:.1f}" for n in names)
            + " |"
        )
    return lines + [""]


def rescaled_markdown(rows: list[dict]) -> list[str]:
    """The simulation with the fit rescaled to the host's speed during each replay."""
    lines = [
        "## The simulation rescaled to the replay's own steps",
        "",
        "A diagnosis, not a prediction: every cost coefficient divided by the replay's "
        "total predicted / measured step seconds (one number taken from the real run), "
        "so that what remains is the simulator's scheduling, not the host's drift "
        "between the fit and the replay.",
        "",
        "| rate (req/s) | rescale | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | "
        "attainment, real / simulated | means, p99s within the bars |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        x = r["rescaled"]
        lines.append(
            f"| {r['rate']:g} | "
            f"x{1 / r['step_error']['all']['total_predicted_over_real']:.3f} | "
            + " | ".join(
                f"{x[m]['error']:+.1%}" for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99")
            )
            + f" | {x['attainment_real']:.1%} / {x['attainment_sim']:.1%} | "
            + ", ".join(YES[v] for v in within_bars(x).values())
            + " |"
        )
    return lines


def repeat_markdown(again: dict | None) -> list[str]:
    """The real engine against itself: one rate's requests replayed a second time."""
    if again is None:
        return []
    lines = [
        "## The real engine against itself",
        "",
        f"The {again['rate']:g} req/s requests again, through a fresh engine after the "
        "other rates. A bar can be judged at this load only where the two real runs "
        "agree within it.",
        "",
        "| metric | first run | second run | difference |",
        "|---|---:|---:|---:|",
    ]
    for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"):
        v = again[m]
        lines.append(
            f"| {m.replace('_', ' ')} (s) | {v['real']:.3f} | {v['sim']:.3f} | {v['error']:+.1%} |"
        )
    bars = within_bars(again)
    return lines + [
        f"| attainment | {again['attainment_real']:.1%} | {again['attainment_sim']:.1%} | |",
        "",
        f"The two real runs agree within the bars: means {YES[bars['mean']]}, "
        f"p99s {YES[bars['p99']]}.",
    ]


def markdown(rep: dict[str, Any]) -> str:
    lines = [
        "# The simulator against the real engine (one run)",
        "",
        f"Trace: {rep['trace']}. One replica, the server's engine settings, admission "
        "off. A fresh calibration before each rate (the first also set the rates):",
        "",
        *fits_markdown(rep["rows"]),
        *targets_markdown(rep["rows"]),
        "## Real against simulated",
        "",
        "| rate (req/s) | metric | real | simulated | error |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rep["rows"]:
        for m in ("ttft_mean", "ttft_p99", "tpot_mean", "tpot_p99"):
            v = r[m]
            lines.append(
                f"| {r['rate']:g} | {m.replace('_', ' ')} (s) | {v['real']:.3f} | "
                f"{v['sim']:.3f} | {v['error']:+.1%} |"
            )
        lines.append(
            f"| {r['rate']:g} | attainment | {r['attainment_real']:.1%} | "
            f"{r['attainment_sim']:.1%} | |"
        )
    g_real, g_sim = goodput(rep["rows"], "attainment_real"), goodput(rep["rows"], "attainment_sim")
    lines += [
        "",
        f"Goodput (>= 90% attainment): real {g_real} req/s, simulated {g_sim} req/s.",
        f"Requests compared per rate: {[r['compared'] for r in rep['rows']]}; cut off "
        f"(real): {[r['cut_off'] for r in rep['rows']]}; preemptions real / simulated: "
        f"{[(r['preemptions_real'], r['preemptions_sim']) for r in rep['rows']]}.",
        "Cost model on the replay's own steps, median predicted / real period (all steps; "
        "decode-only): "
        + ", ".join(
            f"{r['rate']:g} req/s: {r['step_error']['all']['median_predicted_over_real']:.2f}"
            f"; {r['step_error']['decode_only']['median_predicted_over_real']:.2f}"
            for r in rep["rows"]
        )
        + ".",
        "",
        "The simulation with every cost coefficient scaled (mean TTFT / mean TPOT, s; attainment):",
        "",
    ]
    for r in rep["rows"]:
        lines.append(
            f"- {r['rate']:g} req/s: "
            + "; ".join(
                f"x{f} {v['ttft_mean']:.3f} / {v['tpot_mean']:.4f}, {v['attainment']:.1%}"
                for f, v in r["sensitivity"].items()
            )
        )
    return (
        "\n".join(
            lines + ["", *rescaled_markdown(rep["rows"]), "", *repeat_markdown(rep.get("repeat"))]
        )
        + "\n"
    )
