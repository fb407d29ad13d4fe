"""The digital twin end to end: calibrate from a live server, ask a what-if, check it live.

Run from the repository root (it prints its expected duration first)::

    python -m bench.twin

1. ``iterserve serve`` (one replica, admission on, the 70/30 interactive/batch mix of
   :mod:`bench.sim_validate`) serves a window of the conversation trace at ``--load``
   times its capacity, over HTTP.
2. ``iterserve calibrate --from-url`` fits the step-time model on the server's steps, and
   ``iterserve simulate --from-url --cost-model FIT`` replays the server's traffic under
   the what-if plan (``--what-if``: engine settings, default a token budget of 256).
3. The server is restarted with the what-if plan and serves the same window
   ``--repeats`` times; the prediction is judged by layer 3's bars
   (:data:`bench.toolkit.simcheck.BAND`): the simulated mean TTFT and TPOT within the real
   runs' min-max band widened by 5%, the p99 by 10%.

Output: ``bench/results/twin.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.servers import MIX_API_KEY, Server, SystemSpec, model_dir
from bench.toolkit.simcheck import (
    BAND,
    CALIBRATION_RPS,
    MIX,
    SLO,
    STATS,
    capacity,
    closed,
    mix_target,
    probe_requests,
    serve,
    stats,
    window_requests,
)
from bench.toolkit.targets import http_client
from bench.toolkit.workload import ATTRIBUTION, TRACE
from deploy.sim import replay as rpl
from deploy.sim.calibrate import fit_log
from deploy.sim.twin import fetch_log, observed
from engine.core.step_log import window


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = cli.parser("bench.twin", __doc__)
    ap.add_argument("--load", type=float, default=0.8, help="x the measured capacity")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--repeats", type=int, default=3, help="real runs under the what-if plan")
    ap.add_argument(
        "--what-if",
        default="max_num_batched_tokens=256",
        help="engine settings of the plan, comma-separated NAME=INT",
    )
    args = ap.parse_args(argv)
    try:
        args.plan = {k: int(v) for k, v in (p.split("=") for p in args.what_if.split(","))}
    except ValueError:
        ap.error(f"--what-if {args.what_if!r}: expected NAME=INT,...")
    return args


def iterserve(*argv: str) -> str:
    """``iterserve ARGV``; its standard output.

    Raises:
        RuntimeError: it failed (its standard error).
    """
    done = subprocess.run(
        [str(REPO / ".venv/bin/iterserve"), *argv], capture_output=True, text=True, cwd=REPO
    )
    if done.returncode:
        raise RuntimeError(f"iterserve {' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout


async def run_window(server: Server, rate: float, duration: float, seed: int) -> dict:
    """The trace window at ``rate`` through ``server``; its span on the server's clock."""
    async with http_client() as client:
        reqs = window_requests(rate, duration, seed, "twin")
        return await serve(mix_target(client, server.url), reqs, duration + 60)


async def probe(server: Server) -> None:
    """The probe, 4 requests at a time: the what-if server warmed up as the first was."""
    async with http_client() as client:
        await closed(mix_target(client, server.url), probe_requests(1), 4)


def real_stats(url: str, span: dict) -> dict[str, Any]:
    """The run's figures from the server's own step log (``GET /steps``)."""
    log = window(fetch_log(url, MIX_API_KEY), span["start"], span["end"] + 0.5)
    return stats(observed(log, rpl.origin(log)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    expected = 60 + (args.repeats + 1) * (args.duration + 40) + 60
    cli.expected("twin", expected, f"{args.repeats + 1} real runs")
    t_begin = time.perf_counter()
    mdir = model_dir()
    with tempfile.TemporaryDirectory(prefix="twin-") as tmp:
        fit_path, plan_json = Path(tmp) / "cost.json", Path(tmp) / "plan.json"
        with Server(SystemSpec("iterserve", "iterserve"), mdir, mix=True, slo=SLO) as server:
            cal = asyncio.run(run_window(server, CALIBRATION_RPS, 30.0, 9))
            log = window(fetch_log(server.url, MIX_API_KEY), cal["start"], cal["end"] + 0.5)
            outside = rpl.OutsideSteps.of(log)
            cap = capacity(fit_log(log), rpl.service_config(log), 60.0, outside)
            rate = cap * args.load
            print(f"capacity {cap:.2f} req/s; serving {rate:.2f} req/s", flush=True)
            base = asyncio.run(run_window(server, rate, args.duration, 0))
            first = real_stats(server.url, base)
            last = f"{time.monotonic() - base['start'] + 1:.1f}"
            calib = iterserve(
                "calibrate", "--from-url", server.url, "--api-key", MIX_API_KEY,
                "--last", last, "--output", str(fit_path),
            )  # fmt: skip
            plan_flags = [f"--{k.replace('_', '-')}={v}" for k, v in args.plan.items()]
            iterserve(
                "simulate", "--from-url", server.url, "--api-key", MIX_API_KEY, "--last", last,
                "--cost-model", str(fit_path), *plan_flags, "--json", str(plan_json),
            )  # fmt: skip
        predicted = json.loads(plan_json.read_text())["simulated"]
        spec = SystemSpec("iterserve-what-if", "iterserve", engine=dict(args.plan))
        reals = []
        with Server(spec, mdir, mix=True, slo=SLO) as server:
            asyncio.run(probe(server))
            for k in range(args.repeats):
                span = asyncio.run(run_window(server, rate, args.duration, 1 + k))
                reals.append(real_stats(server.url, span))
                print(f"what-if run {k + 1}: {reals[-1]}", flush=True)
    sim = {m: predicted["latency"][f"{m}_s"] for m in STATS}
    verdicts = {}
    for m in STATS:
        vals = [r[m] for r in reals if r[m] is not None]
        widen = BAND[m.split("_")[1]]
        lo, hi = min(vals), max(vals)
        verdicts[m] = {
            "real_min": lo,
            "real_max": hi,
            "spread": hi / lo - 1,
            "sim": sim[m],
            "within": lo * (1 - widen) <= sim[m] <= hi * (1 + widen),
        }
    rep = {
        "run": rp.run_record(),
        "trace": f"{TRACE.name} from row 3000, lengths / 8, {MIX}; {ATTRIBUTION}",
        "args": {k: v for k, v in vars(args).items()},
        "capacity_rps": cap,
        "rate_rps": rate,
        "as_served": first,
        "calibration": calib,
        "what_if": args.plan,
        "predicted": predicted,
        "real": reals,
        "verdicts": verdicts,
        "wall_s": time.perf_counter() - t_begin,
    }
    rp.write_report(RESULTS / "twin.json", rep, markdown(rep))
    return 0


def markdown(rep: dict[str, Any]) -> str:
    plan = ", ".join(f"{k} = {v}" for k, v in rep["what_if"].items())
    lines = [
        "# The digital twin: a what-if from a live calibration, checked live",
        "",
        f"Trace: {rep['trace']}. The server (defaults) served {rep['rate_rps']:.2f} req/s "
        f"(capacity {rep['capacity_rps']:.2f} req/s), was calibrated with `iterserve "
        f"calibrate --from-url`, and `iterserve simulate --from-url` predicted the same "
        f"traffic under {plan}; the server then ran with {plan} and served the same window "
        f"{len(rep['real'])} times.",
        "",
        "| statistic (s) | as served (defaults) | predicted | real min | real max | real "
        "spread | within the band (mean +-5%, p99 +-10%) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for m, v in rep["verdicts"].items():
        lines.append(
            f"| {m.replace('_', ' ')} | {rep['as_served'][m]:.3f} | {v['sim']:.3f} | "
            f"{v['real_min']:.3f} | {v['real_max']:.3f} | {v['spread']:.1%} | "
            f"{'yes' if v['within'] else 'no'} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
