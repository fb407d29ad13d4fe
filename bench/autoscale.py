"""A simulated day under three fleets: fixed for the peak, Ray Serve's default
autoscaling, and iterserve's SLO autoscaler (issue "autoscale", item 3).

    python -m bench.autoscale            # 24 simulated hours (prints its expected duration)
    python -m bench.autoscale --quick    # a 2-hour day, for a smoke check

The load: the shipped conversation trace (Azure LLM inference 2023, CC-BY 4.0), lengths
divided by ``--length-scale``, classes drawn interactive/batch, tiled over the day at the
peak rate and thinned to a diurnal envelope (:class:`deploy.sim.autoscale.Diurnal`:
peak/trough ``--ratio``, trough at midnight, peak at noon). Every fleet runs the real
scheduler, admission and router in virtual time (:class:`deploy.sim.fleet.Fleet`) with
the shipped CPU cost model, and a new replica serves ``--replica-start-s`` after it is
asked for.

* (a) **fixed**: the fewest replicas that keep every class at >= 99% attainment on an hour
  at the peak rate (``iterserve simulate --search``'s first stage, on that hour).
* (b) **Ray default**: Ray Serve's ``replica_queue_length_autoscaling_policy`` with its
  delays (30 s up, 600 s down), its ``target_ongoing_requests`` set to the requests per
  replica that the fixed fleet held at the peak (Little's law on its peak hour: what a
  user would tune it to). ``--ray-target`` overrides.
* (c) **SLO policy**: :class:`policies.autoscale.SloAutoscaler` with the config's
  defaults.

Writes ``bench/results/autoscale.json`` and ``autoscale.md`` (replica-hours, per-class
attainment and refusals, scaling actions) and ``autoscale.png`` (replicas over the day).
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.toolkit import cli
from bench.toolkit import report as rp
from deploy.config import ServiceConfig
from deploy.sim.autoscale import (
    Diurnal,
    QueueLengthScaler,
    diurnal_requests,
    replica_hours,
)
from deploy.sim.cli import cost_model
from deploy.sim.fleet import Autoscaling, Fleet, SimRun
from deploy.sim.report import ATTAINMENT, all_classes_meet, summarize
from deploy.sim.trace import TraceSpec, parse_mix
from policies.autoscale import SloAutoscaler

FIXED_ATTAINMENT = 0.99
"""Every class's attainment the fixed fleet must keep at the peak (``--search``'s own bar
is lower; this one is the SLO policy's interactive target)."""

PEAK_S = 600.0
"""Seconds at the peak rate on which the fixed fleet is sized."""

MS_PER_REQUEST = 3.0
"""Wall milliseconds one simulated request costs here, for the expected duration only."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser("bench.autoscale", __doc__)
    p.add_argument("--trace", default="conv", help="a shipped trace's name, or a CSV")
    p.add_argument("--length-scale", type=float, default=4.0)
    p.add_argument("--class-mix", default="interactive=0.7,batch=0.3")
    p.add_argument("--peak-rps", type=float, default=6.0, help="arrivals per second at noon")
    p.add_argument("--ratio", type=float, default=3.0, help="peak / trough rate")
    p.add_argument("--day-s", type=float, default=86400.0, help="simulated seconds of the day")
    p.add_argument("--replica-start-s", type=float, default=20.0)
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--ray-target", type=float, default=None)
    cli.add_seed(p)
    cli.add_quick(p, "a 2-hour day (--day-s 7200)")
    cli.add_out(p, "bench/results", "the folder of the result files")
    p.add_argument(
        "--name", default="autoscale", help="the result files' stem (NAME.json, .md, .png)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.day_s = 7200.0
    return args


def _setup(args: argparse.Namespace) -> tuple[ServiceConfig, Any, TraceSpec]:
    cost = cost_model(
        argparse.Namespace(gpu=None, model_size=None, cost_model=None, tensor_parallel=1)
    )
    config = ServiceConfig(
        autoscaling={
            "min_replicas": 1,
            "max_replicas": args.max_replicas,
            "replica_start_s": args.replica_start_s,
        }
    )
    spec = TraceSpec(
        args.trace,
        length_scale=args.length_scale,
        mix=parse_mix(args.class_mix),
        seed=args.seed,
    )
    return config, cost, spec


def _fixed(config: ServiceConfig, n: int) -> ServiceConfig:
    data = config.model_dump(exclude={"engine": {"model"}, "autoscaling": True})
    data.update(num_replicas=n, autoscaling=None)
    return ServiceConfig(**data)


def run_fleet(job: tuple[str, argparse.Namespace, int, float | None]) -> dict[str, Any]:
    """One day: ``(kind, args, fixed replicas, Ray's target)`` -> its figures."""
    kind, args, n, ray_target = job
    config, cost, spec = _setup(args)
    curve = Diurnal(args.day_s, args.peak_rps, args.ratio)
    requests = diurnal_requests(spec, curve, args.seed)
    settings = config.autoscaling_settings()
    t0 = time.perf_counter()
    if kind == "fixed":
        fleet = Fleet(_fixed(config, n), cost, seed=args.seed)
    else:
        scaler = (
            QueueLengthScaler(settings, ray_target)
            if kind == "ray-default"
            else SloAutoscaler(settings, config.traffic_classes())
        )
        fleet = Fleet(
            config,
            cost,
            seed=args.seed,
            autoscaling=Autoscaling(scaler, settings, args.replica_start_s),
        )
    run = fleet.run(requests)
    return _figures(kind, run, config, args, time.perf_counter() - t0)


def _figures(
    kind: str, run: SimRun, config: ServiceConfig, args: argparse.Namespace, wall_s: float
) -> dict[str, Any]:
    summary = summarize(run, config.traffic_classes())
    return {
        "fleet": kind,
        "replica_hours": replica_hours(run.replica_s, args.day_s),
        "scaling_actions": len(run.decisions),
        "decisions": [[round(d.t, 1), d.target, d.reason] for d in run.decisions],
        "requests": summary["requests"],
        "attainment": summary["attainment"],
        "classes": {
            name: {
                "requests": c["requests"],
                "attainment": c["attainment"],
                "refused": c["refused"],
                "ttft_p99_s": c["ttft_p99_s"],
                "tpot_p99_s": c["tpot_p99_s"],
            }
            for name, c in summary["classes"].items()
        },
        "end_s": run.end_s,
        "wall_s": wall_s,
    }


def size_for_peak(args: argparse.Namespace) -> tuple[int, float, list[dict[str, Any]]]:
    """The fewest fixed replicas meeting every class's SLOs over ``PEAK_S`` seconds at the
    peak rate, and the requests per replica they held then (running and queued: Ray's
    "ongoing requests").

    The search starts where the SLO policy's demand model puts the peak at full
    utilization and walks by one replica: a badly overloaded fleet queues without bound
    and would cost far more to simulate than the answer is worth.
    """
    config, cost, spec = _setup(args)
    peak = diurnal_requests(spec, Diurnal(PEAK_S, args.peak_rps, 1.0), args.seed)
    tried: dict[int, tuple[bool, float]] = {}
    log = []

    def meets(n: int) -> bool:
        if n not in tried:
            run = Fleet(_fixed(config, n), cost, seed=args.seed).run(peak)
            summary = summarize(run, config.traffic_classes())
            per = [s.running + s.waiting for s in run.timeline]
            tried[n] = (all_classes_meet(summary, FIXED_ATTAINMENT), sum(per) / max(1, len(per)))
            log.append({"replicas": n, "meets": tried[n][0], "attainment": summary["attainment"]})
            print(
                f"  {PEAK_S / 60:g} min at the peak, {n} fixed replicas: attainment "
                f"{summary['attainment']:.2%}",
                flush=True,
            )
        return tried[n][0]

    n = max(1, math.floor(_peak_demand(args, peak)))
    while not meets(n):
        if n >= args.max_replicas:
            raise SystemExit(f"{args.max_replicas} replicas miss the SLOs at the peak")
        n += 1
    while n > 1 and meets(n - 1):
        n -= 1
    return n, tried[n][1], log


def _peak_demand(args: argparse.Namespace, peak: list) -> float:
    """Replicas the SLO policy's demand model wants for ``peak`` at full utilization."""
    from policies.autoscale import ClassLoad, FleetState

    config, _, _ = _setup(args)
    policy = SloAutoscaler(config.autoscaling_settings(), config.traffic_classes())
    classes: dict[str, ClassLoad] = {}
    for r in peak:
        c = classes.get(r.traffic_class, ClassLoad())
        classes[r.traffic_class] = ClassLoad(
            arrived=c.arrived + 1,
            prompt_tokens=c.prompt_tokens + r.prompt_tokens,
            output_tokens=(c.output_tokens * c.arrived + r.output_tokens) / (c.arrived + 1),
        )
    state = FleetState(now_s=0.0, running=1, target=1, classes=classes, window_s=PEAK_S)
    return policy.demand_replicas(state, 1.0)[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, _, spec = _setup(args)
    curve = Diurnal(args.day_s, args.peak_rps, args.ratio)
    n_requests = len(diurnal_requests(spec, curve, args.seed))
    expected = (n_requests * 3 / 2 + args.peak_rps * PEAK_S * 3) * MS_PER_REQUEST / 1000
    cli.expected(
        "autoscale",
        expected,
        f"on 2 cores: {n_requests} requests over {args.day_s / 3600:g} simulated hours, peak "
        f"{args.peak_rps:g} req/s, peak/trough {args.ratio:g}",
    )
    t0 = time.perf_counter()
    n, per_replica, sizing = size_for_peak(args)
    target = args.ray_target or max(1.0, round(per_replica, 1))
    print(f"fixed fleet: {n} replicas; Ray's target_ongoing_requests: {target:g}", flush=True)
    jobs = [
        ("fixed", args, n, None),
        ("ray-default", args, n, target),
        ("slo-policy", args, n, None),
    ]
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(run_fleet, jobs))
    report = {
        "run": rp.run_record(),  # the markdown quotes it
        "trace": f"{args.trace} (Azure LLM inference 2023, CC-BY 4.0), lengths / "
        f"{args.length_scale:g}, classes {args.class_mix}",
        "curve": {
            "day_s": args.day_s,
            "peak_rps": args.peak_rps,
            "ratio": args.ratio,
            "mean_rps": curve.mean_rate(),
            "shape": Diurnal.__doc__.split("\n\n")[0].replace("\n", " ") if Diurnal.__doc__ else "",
        },
        "replica_start_s": args.replica_start_s,
        "fixed_replicas": n,
        "ray_target_ongoing_requests": target,
        "sizing": sizing,
        "settings": config.autoscaling.model_dump() if config.autoscaling else {},
        "fleets": results,
        "targets": verdicts(results),
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    rp.write_report(out / f"{args.name}.json", report, markdown(report))
    _plot(report, out / f"{args.name}.png")
    return 0


def verdicts(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, each with the figures it compares."""
    by = {r["fleet"]: r for r in results}
    a, b, c = by["fixed"], by["ray-default"], by["slo-policy"]
    inter = c["classes"].get("interactive", {}).get("attainment") or 0.0
    saving = 1 - c["replica_hours"] / a["replica_hours"]
    return {
        "interactive_attainment_ge_99": {"value": inter, "met": inter >= ATTAINMENT},
        "replica_hours_saving_vs_fixed_ge_30pct": {"value": saving, "met": saving >= 0.30},
        "higher_attainment_than_ray_default_at_no_more_replica_hours": {
            "attainment": [c["attainment"], b["attainment"]],
            "replica_hours": [c["replica_hours"], b["replica_hours"]],
            "met": c["attainment"] > b["attainment"] and c["replica_hours"] <= b["replica_hours"],
        },
    }


def bound_replica_hours(curve: Diurnal, fixed: int, steps: int = 8640) -> float:
    """Replica-hours of a day (real hours) for a fleet that always runs exactly the
    replicas its arrival rate needs, each at the load per replica of the fixed fleet at
    the peak, and starts them in no time: the reference for what scaling can save on this
    curve at this fleet size. A policy can use fewer only by loading replicas more than the
    fixed fleet did at the peak (its count is rounded up)."""
    per_replica = curve.peak_rps / fixed
    need = [
        max(1, math.ceil(curve.rate((k + 0.5) * curve.day_s / steps) / per_replica - 1e-9))
        for k in range(steps)
    ]
    return sum(need) / steps * 24.0


def _pct(x: float | None) -> str:
    """Attainment to two decimals: the fleets differ below a whole percent."""
    return rp.pct(x, digits=2)


def markdown(rep: dict[str, Any]) -> str:
    names = sorted({n for f in rep["fleets"] for n in f["classes"]})
    head = ["fleet", "replica-hours", "scaling actions", "attainment"]
    head += [f"{n} attainment / refused" for n in names]
    rows = []
    for f in rep["fleets"]:
        row = [
            f["fleet"],
            f"{f['replica_hours']:.1f}",
            str(f["scaling_actions"]),
            _pct(f["attainment"]),
        ]
        for n in names:
            c = f["classes"].get(n, {})
            row.append(f"{_pct(c.get('attainment'))} / {c.get('refused', 0)}")
        rows.append(row)
    c = rep["curve"]
    t = rep["targets"]
    lines = [
        "# Autoscaling over a simulated day",
        "",
        f"Run: {rep['run']['date']}, commit {rep['run']['commit']}, {rep['run']['host']}: "
        f"`{rep['run']['command']}` ({rep['wall_s'] / 60:.1f} min).",
        "",
        f"Trace: {rep['trace']}. Day: {c['day_s'] / 3600:g} simulated hours, "
        f"{c['peak_rps']:g} req/s at the peak, peak/trough {c['ratio']:g}, mean "
        f"{c['mean_rps']:.2f} req/s. {' '.join(c['shape'].split())} A replica serves "
        f"{rep['replica_start_s']:g} s after it is asked for.",
        "",
        f"(a) fixed: {rep['fixed_replicas']} replicas, the fewest meeting every class's SLOs "
        f"over {PEAK_S / 60:g} minutes at the peak. (b) Ray Serve's default policy, "
        f"target_ongoing_requests {rep['ray_target_ongoing_requests']:g} (the fixed fleet's "
        "requests per replica at the peak). (c) iterserve's SLO policy, default settings.",
        "",
        rp.table(head, rows),
        "",
        "Replica-hours count a replica from the moment it is asked for until it stops.",
        "",
        "| target | figures | met |",
        "|---|---|---|",
        f"| (c) interactive attainment >= 99% | "
        f"{_pct(t['interactive_attainment_ge_99']['value'])} | "
        f"{'yes' if t['interactive_attainment_ge_99']['met'] else 'no'} |",
        f"| (c) >= 30% fewer replica-hours than (a) | "
        f"{t['replica_hours_saving_vs_fixed_ge_30pct']['value']:.1%} fewer | "
        f"{'yes' if t['replica_hours_saving_vs_fixed_ge_30pct']['met'] else 'no'} |",
    ]
    c = rep["curve"]
    bound = bound_replica_hours(
        Diurnal(c["day_s"], c["peak_rps"], c["ratio"]), rep["fixed_replicas"]
    )
    fixed_hours = next(f["replica_hours"] for f in rep["fleets"] if f["fleet"] == "fixed")
    lines.append(
        f"| (reference) a fleet that runs exactly the replicas the rate needs, each at the "
        f"fixed fleet's peak load per replica, started in no time | {bound:.1f} replica-hours, "
        f"{1 - bound / fixed_hours:.1%} fewer than (a) | — |"
    )
    h = t["higher_attainment_than_ray_default_at_no_more_replica_hours"]
    lines.append(
        f"| (c) higher attainment than (b) at no more replica-hours | attainment "
        f"{_pct(h['attainment'][0])} vs {_pct(h['attainment'][1])}, replica-hours "
        f"{h['replica_hours'][0]:.1f} vs {h['replica_hours'][1]:.1f} | "
        f"{'yes' if h['met'] else 'no'} |"
    )
    lines.append("")
    return "\n".join(lines)


def _plot(rep: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = rep["curve"]
    curve = Diurnal(c["day_s"], c["peak_rps"], c["ratio"])
    fig, ax = plt.subplots(figsize=(9, 4))
    hours = [i / 100 * c["day_s"] for i in range(101)]
    ax2 = ax.twinx()
    ax2.plot([h / 3600 for h in hours], [curve.rate(h) for h in hours], "k:", label="req/s")
    ax2.set_ylabel("arrivals (req/s)")
    for f in rep["fleets"]:
        if f["fleet"] == "fixed":
            xs, ys = [0, c["day_s"] / 3600], [rep["fixed_replicas"]] * 2
        else:
            xs, ys = [0.0], [1]
            for t, target, _ in f["decisions"]:
                xs += [t / 3600, t / 3600]
                ys += [ys[-1], target]
            xs.append(c["day_s"] / 3600)
            ys.append(ys[-1])
        ax.plot(xs, ys, label=f["fleet"])
    ax.set_xlabel("simulated hour")
    ax.set_ylabel("replicas (target)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
