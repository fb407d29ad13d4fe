"""The digital twin: the simulator fed from a server's own step log.

* ``iterserve calibrate --from-url URL`` fits :class:`engine.core.step_cost.LinearCost` on the
  server's recent steps (``GET /steps``, :mod:`engine.core.step_log`), and reports the fit's
  error per step kind on the later half of them, fitted on the earlier half.
* ``iterserve simulate --from-url URL`` replays the server's recent arrivals through
  :class:`deploy.sim.fleet.Fleet` under a changed plan (replicas, token budget, chunk
  size, SLOs: the simulate flags), with that fit, and prints what the server did beside
  what the plan would do: attainment, goodput and refusals per class.
* ``iterserve simulate --replay-steps FILE`` replays a step log step for step
  (:mod:`deploy.sim.replay`) and reports where the simulation and the server part.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from deploy.config import ServiceConfig
from deploy.sim import replay as rp
from deploy.sim.calibrate import errors_by_kind, fit_log, holdout
from deploy.sim.fleet import Fleet, Outcome, SimRun
from deploy.sim.report import describe, summarize, table, writable_file
from engine.core.step_cost import LinearCost
from engine.core.step_log import StepLog

FETCH_TIMEOUT_S = 30.0


def fetch_log(url: str, api_key: str | None = None, last_s: float | None = None) -> StepLog:
    """The step log a server keeps (``GET URL/steps``), its last ``last_s`` seconds.

    Raises:
        ValueError: the server cannot be reached, refuses (its error message), or sends
            no step log.
    """
    endpoint = url.rstrip("/") + "/steps"
    params = {} if last_s is None else {"seconds": str(last_s)}
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(endpoint, params=params, headers=headers, timeout=FETCH_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"{endpoint}: cannot reach the server ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise ValueError(f"{endpoint}: {r.status_code}: {message}")
    try:
        return StepLog.parse(r.json()["records"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{endpoint}: not a step log ({e})") from None


def observed(log: StepLog, t0: float) -> SimRun:
    """What the server did with the log's requests, as a simulated run's outcomes (times
    from ``t0``), so :func:`deploy.sim.report.summarize` reports both alike."""
    outcomes = []
    for req in rp.requests(log, t0):
        r = log.requests[req.id]
        o = Outcome(req)
        if r.refused is not None:
            o.status, o.reason = "refused", r.reason
        elif r.finish_reason == "abort":
            o.status = "aborted"
        elif r.finish is not None and r.first_token is not None and r.finish_reason != "abort":
            o.status, o.replica = "ok", 0
            o.first_token_s, o.finish_s = r.first_token - t0, r.finish - t0
        outcomes.append(o)
    busy = sum(s.period for s in log.steps)
    end = max([s.start + s.period - t0 for s in log.steps] or [0.0])
    return SimRun(
        outcomes, [], sum(len(s.preempted) for s in log.steps), len(log.steps), [busy], end
    )


def _complete(log: StepLog) -> StepLog:
    """The log without requests still running or cut off at its start (no finish and no
    refusal): they have no outcome to compare."""
    done = {
        k: r
        for k, r in log.requests.items()
        if r.refused is not None or (r.finish is not None and r.first_token is not None)
    }
    return StepLog(log.engine, log.steps, done)


def base_config(path: str | None, log: StepLog) -> ServiceConfig:
    """The plan's starting point: the config file at ``path``, else the service the log
    was recorded under.

    Raises:
        FileNotFoundError, ValueError, pydantic.ValidationError: a bad config file.
    """
    return ServiceConfig.load(path) if path else rp.service_config(log)


def _kind_table(errors: dict[str, dict[str, float]]) -> str:
    lines = ["| step kind | steps | median abs error | p90 abs error | mean error |"]
    lines.append("|---|---:|---:|---:|---:|")
    for kind, e in errors.items():
        if not e["count"]:
            lines.append(f"| {kind} | 0 | - | - | - |")
            continue
        lines.append(
            f"| {kind} | {e['count']} | {e['median_abs']:.1%} | {e['p90_abs']:.1%} | "
            f"{e['mean']:+.1%} |"
        )
    return "\n".join(lines)


def from_url_command(args: argparse.Namespace, log: StepLog, config: ServiceConfig) -> int:
    """``iterserve simulate --from-url``: the server's recent traffic (``log``) under the
    plan (``config``)."""
    log = _complete(log)
    if not log.requests:
        raise ValueError(f"{args.from_url}: no finished or refused request in its step log yet")
    check_classes_in_log(log, config)
    cost = LinearCost.load(args.cost_model) if args.cost_model else fit_log(log)
    print(f"cost model: {args.cost_model or 'fitted on the server steps'} ({cost.source})")
    t0 = rp.origin(log)
    served = summarize(observed(log, t0), config.traffic_classes())
    reqs = rp.requests(log, t0)
    outside = rp.OutsideSteps.of(log)
    print(outside.describe())
    fleet = Fleet(
        config,
        cost,
        routing=args.routing,
        seed=args.seed,
        live_loads=config.num_replicas == 1,
        **outside.fleet_args(reqs),
    )
    run = fleet.run(reqs, rp.cancels(log, t0))
    planned = summarize(run, config.traffic_classes())
    print(f"\n## As served: {len(log.requests)} requests, {len(log.steps)} steps\n")
    print(table(served))
    print(f"\n## The plan: {config.num_replicas} replica(s), simulated\n")
    print(table(planned))
    if args.json:
        report = {
            "url": args.from_url,
            "config": config.model_dump(mode="json"),
            "cost_model": describe(cost),
            "served": served,
            "simulated": planned,
        }
        _write(args.json, report)
    return 0


def check_classes_in_log(log: StepLog, config: ServiceConfig) -> None:
    """Raises:
    ValueError: a logged request's class is not among the plan's classes.
    """
    known = config.traffic_classes()
    missing = sorted({r.traffic_class for r in log.requests.values()} - set(known))
    if missing:
        raise ValueError(
            f"the log has requests of classes {missing} that the plan does not define "
            f"(known: {sorted(known)}); give them in --config"
        )


def replay_command(args: argparse.Namespace, log: StepLog, config: ServiceConfig) -> int:
    """``iterserve simulate --replay-steps``: ``log`` step for step under ``config``, and
    the fidelity report."""
    check_classes_in_log(log, config)
    fallback = LinearCost.load(args.cost_model) if args.cost_model else fit_log(log)
    if config.num_replicas != 1:
        raise ValueError(
            "--replay-steps replays the recorded replica step for step; for other replica "
            "counts, use --from-url against the server, or --trace"
        )
    rep = rp.replay(log, config, fallback)
    result = rp.compare(log, rep)
    served = summarize(observed(log, rep.t0), config.traffic_classes())
    replayed = summarize(rep.run, config.traffic_classes())
    print(f"replayed {args.replay_steps}: {len(log.requests)} requests, {len(log.steps)} steps")
    print(f"\n## As served\n\n{table(served)}\n\n## Replayed\n\n{table(replayed)}\n")
    print(fidelity_text(result))
    if args.json:
        report = {
            "step_log": args.replay_steps,
            "config": config.model_dump(mode="json"),
            "fallback_cost_model": describe(fallback),
            "served": served,
            "replayed": replayed,
            "fidelity": result,
        }
        _write(args.json, report)
    return 0


def fidelity_text(result: dict[str, Any]) -> str:
    """The replay's agreement with the log, for the terminal."""
    steps = result["steps"]
    lines = [
        "## Decision fidelity",
        "",
        f"steps: {steps['real']} real, {steps['simulated']} simulated; "
        f"{steps['matched']} priced from a real step of the same composition, "
        f"{steps['near']} from the next real step scaled by the fit, "
        f"{steps['unmatched']} by the fit alone",
        f"requests admitted in one run and not the other: {len(result['status_differs'])}",
    ]
    for m in ("ttft", "tpot"):
        r = result[m]
        if r["compared"]:
            lines.append(
                f"{m.upper()}: {r['compared']} requests, median |error| "
                f"{r['median_abs']:.2%}, p99 |error| {r['p99_abs']:.2%} "
                f"(bars {rp.BARS['median']:.0%}, {rp.BARS['p99']:.0%})"
            )
    d = result["divergence"]
    lines.append(
        "every step the same, step for step"
        if d is None
        else f"first divergent step: {d['step']}: {d['why']}"
    )
    return "\n".join(lines)


def calibrate_from_url(args: argparse.Namespace) -> int:
    """``iterserve calibrate --from-url``: fit on the server's recent steps, write it."""
    if not writable_file(args.output):
        raise ValueError(f"--output {args.output}: not a file in a writable directory")
    log = fetch_log(args.from_url, args.api_key, args.last)
    if len(log.steps) < 20:
        raise ValueError(
            f"{args.from_url}: {len(log.steps)} steps in its history; serve some traffic first"
        )
    _, errors = holdout(log)
    source = (
        f"{log.engine.get('model')} at {args.from_url}: {len(log.steps)} steps, "
        f"held-out median |error| {errors['all']['median_abs']:.1%}"
    )
    cost = fit_log(log, source=source)
    cost.save(args.output)
    print(f"fitted on {len(log.steps)} steps of {args.from_url}", file=sys.stderr)
    print("The fit on the earlier half of these steps, against the later half:\n")
    print(_kind_table(errors))
    print(f"\nthe fit on all of them, in-sample:\n\n{_kind_table(errors_by_kind(cost, log.steps))}")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _write(path: str, report: dict[str, Any]) -> None:
    """``--json``: the report (a log's fields that JSON lacks, such as numpy numbers, as
    text)."""
    Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")
