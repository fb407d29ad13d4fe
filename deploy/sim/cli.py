"""``iterserve simulate`` and ``iterserve calibrate``: arguments, runs, output."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.sim import ROUTING
from deploy.sim.autoscale import AUTOSCALE_MAX_REPLICAS
from deploy.sim.report import describe, writable_file
from deploy.sim.trace import TraceSpec, parse_mix

if TYPE_CHECKING:
    from deploy.config import ServiceConfig

DEFAULT_COST_MODEL = "cpu_smollm2_135m.json"
"""Shipped in ``deploy/sim``: ``iterserve calibrate`` on the project's 2-core CPU host
(SmolLM2-135M-Instruct, fp32). Calibrate on your own machine for its figures."""
MAX_REPLICAS = 64
"""``--search``'s default upper bound on replicas."""
ENGINE_FLAGS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "long_prefill_token_threshold",
    "policy",
    "block_size",
    "num_kv_blocks",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        help="a shipped trace (conv, code: Azure LLM inference 2023, CC-BY 4.0), "
        "an Azure trace CSV, or JSONL of {arrival_s, prompt_tokens, "
        "output_tokens, class?, prompt_key?, model?} (one key: one shared prompt; "
        "model: a LoRA adapter's name)",
    )
    src.add_argument(
        "--replay-steps",
        metavar="FILE",
        help="a server's step log (iterserve serve --step-log): replay its arrivals, each "
        "step costing what the real step of the same composition measured, and compare "
        "request by request",
    )
    src.add_argument(
        "--from-url",
        metavar="URL",
        help="a running server (http://HOST:PORT): replay its recent traffic (GET /steps) "
        "under this plan, with a step-time model fitted on its recent steps",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="model replicas (default: the config's num_replicas, else 1)",
    )
    p.add_argument("--config", default=None, help="a ServiceConfig YAML (iterserve serve's)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    w = p.add_argument_group("trace window")
    w.add_argument("--window-start", type=float, default=0.0, help="trace seconds to skip")
    w.add_argument("--duration", type=float, default=None, help="trace seconds to replay")
    w.add_argument(
        "--rate-scale",
        default="1",
        help="arrival rate multiplier; a comma "
        "list sweeps rates and reports goodput (e.g. 0.5,1,2)",
    )
    w.add_argument(
        "--length-scale", type=float, default=1.0, help="divide prompt and output lengths by this"
    )
    w.add_argument(
        "--class-mix",
        default=None,
        help="e.g. interactive=0.7,batch=0.3 (CSV traces; JSONL lines may carry their own class)",
    )
    w.add_argument("--default-class", default="standard")
    s = p.add_argument_group("service")
    s.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="CLASS=TTFT,TPOT",
        help="a class's SLOs in seconds (repeatable)",
    )
    s.add_argument("--admission", choices=("on", "off"), default=None)
    s.add_argument("--routing", choices=ROUTING, default="load-aware")
    s.add_argument("--tpot-slo-guard", choices=("on", "off"), default=None)
    for flag in ENGINE_FLAGS:
        kind = str if flag == "policy" else int
        s.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    c = p.add_argument_group("cost model (default: the shipped CPU calibration)")
    c.add_argument("--cost-model", default=None, help="a file from iterserve calibrate")
    c.add_argument("--gpu", default=None, help="roofline on a GPU: h100-sxm or h200")
    c.add_argument("--model-size", default=None, help="with --gpu: 0.5b, 8b or 70b")
    c.add_argument("--tensor-parallel", type=int, default=1, help="with --gpu: GPUs per replica")
    c.add_argument(
        "--lora-token-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a step adds per token per LoRA adapter in it (default: the cost "
        "model's lora_token_s, 0 where it has none)",
    )
    c.add_argument(
        "--lora-step-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a step with any LoRA adapter adds (default: the cost model's "
        "lora_step_s, 0 where it has none)",
    )
    c.add_argument(
        "--lora-adapter-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a step adds per LoRA adapter in it (default: the cost model's "
        "lora_adapter_s, 0 where it has none)",
    )
    server_arguments(p.add_argument_group("a running server (--from-url)"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--search",
        action="store_true",
        help="find the fewest replicas and the "
        "engine settings that meet the SLOs (at the first --rate-scale)",
    )
    p.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help=f"--search's upper bound (default {MAX_REPLICAS}); --autoscale's, where the "
        f"config sets none (default {AUTOSCALE_MAX_REPLICAS})",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="scale the fleet with the SLO autoscaler (policies/autoscale.py) in virtual "
        "time, within the config's autoscaling section (default: its defaults, from 1 "
        "replica), and report replica-hours and every decision",
    )
    p.add_argument(
        "--replica-start-s",
        type=float,
        default=None,
        help="with --autoscale: seconds from a replica being asked for to its first request "
        "(default: the config's autoscaling.replica_start_s)",
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="switch each TPOT guard rule off in turn and report its effect",
    )


def server_arguments(group) -> None:
    """``--last`` and ``--api-key``, how ``--from-url`` reads a server's ``GET /steps``
    (``iterserve simulate`` and ``iterserve calibrate`` both take them)."""
    group.add_argument(
        "--last",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --from-url: the server's last SECONDS of steps and traffic "
        "(default: all it keeps)",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="with --from-url: the server's API key, if it has keys (default: $OPENAI_API_KEY)",
    )


def cost_model(args: argparse.Namespace):
    """The cost model the flags name.

    Raises:
        ValueError: --gpu without --model-size (or the reverse), unknown names, or a
            LoRA term below 0.
    """
    cost = _cost_model(args)
    terms = {
        k: getattr(args, k)
        for k in ("lora_token_s", "lora_step_s", "lora_adapter_s")
        if getattr(args, k, None) is not None
    }
    return dataclasses.replace(cost, **terms) if terms else cost


def _cost_model(args: argparse.Namespace):
    from deploy.sim.roofline import RooflineCost
    from engine.core.step_cost import LinearCost

    if args.gpu or args.model_size:
        if not (args.gpu and args.model_size):
            raise ValueError("--gpu and --model-size go together")
        return RooflineCost.named(args.model_size, args.gpu, tensor_parallel=args.tensor_parallel)
    if args.cost_model:
        return LinearCost.load(args.cost_model)
    with resources.as_file(resources.files("deploy.sim") / DEFAULT_COST_MODEL) as path:
        return LinearCost.load(path)


def service_config(args: argparse.Namespace, base: ServiceConfig | None = None) -> ServiceConfig:
    """The config file (or ``base``: a step log's service) with the flags applied.

    Raises:
        ValueError: a malformed --slo; pydantic.ValidationError: a bad value.
    """
    from deploy.config import ServiceConfig
    from deploy.sim.runs import with_engine

    if base is None:
        config = ServiceConfig.load(args.config, num_replicas=args.replicas)
    elif args.replicas is not None:
        config = with_engine(base, {"num_replicas": args.replicas})
    else:
        config = base
    engine = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.tpot_slo_guard is not None:
        engine["tpot_slo_guard"] = args.tpot_slo_guard == "on"
    classes = {k: dict(v) for k, v in (config.engine.traffic_classes or {}).items()}
    known = config.traffic_classes()
    for item in args.slo:
        name, _, values = item.partition("=")
        if name not in known:
            raise ValueError(
                f"--slo {item!r}: unknown traffic class {name!r} (known: "
                f"{sorted(known)}; a new one needs its fields in --config)"
            )
        try:
            ttft, tpot = (float(x) for x in values.split(","))
        except ValueError:
            raise ValueError(f"--slo {item!r}: expected CLASS=TTFT,TPOT in seconds") from None
        classes.setdefault(name, {}).update(ttft_slo_s=ttft, tpot_slo_s=tpot)
    engine["traffic_classes"] = classes or None
    top = {} if args.admission is None else {"admission": args.admission == "on"}
    return with_engine(config, top, **engine)


def trace_spec(args: argparse.Namespace, rate_scale: float) -> TraceSpec:
    return TraceSpec(
        args.trace,
        args.window_start,
        args.duration,
        rate_scale,
        args.length_scale,
        parse_mix(args.class_mix),
        args.default_class,
        args.seed,
    )


def trace_info(args: argparse.Namespace) -> dict[str, Any]:
    """The trace window the flags select (rates aside), for reports."""
    info = dataclasses.asdict(trace_spec(args, 1.0))
    del info["rate_scale"]
    return info


def rates(args: argparse.Namespace) -> list[float]:
    try:
        out = [float(x) for x in args.rate_scale.split(",")]
    except ValueError:
        raise ValueError(f"--rate-scale {args.rate_scale!r}: numbers, comma-separated") from None
    if not out or min(out) <= 0:
        raise ValueError("--rate-scale values must be > 0")
    return out


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags the run would ignore, and output paths it could not write, before
    anything runs.

    Raises:
        ValueError: which flag, and why.
    """
    ignored = [
        (args.tensor_parallel != 1 and not args.gpu, "--tensor-parallel goes with --gpu"),
        (args.cost_model and args.gpu, "--cost-model and --gpu name two cost models"),
        (args.search and args.ablate, "--search and --ablate are two runs: give one"),
        (
            args.plots and (args.search or args.ablate),
            "--plots draws a plain run or a sweep, not --search or --ablate",
        ),
        (
            args.max_replicas is not None and not (args.search or args.autoscale),
            "--max-replicas goes with --search or --autoscale",
        ),
        (
            args.autoscale and (args.search or args.ablate),
            "--autoscale is one run: drop --search and --ablate",
        ),
        (
            args.autoscale and args.replicas is not None,
            "--autoscale chooses the replica count (the config's autoscaling bounds and "
            "--max-replicas): drop --replicas",
        ),
        (
            args.replica_start_s is not None and not args.autoscale,
            "--replica-start-s goes with --autoscale",
        ),
        (
            args.replica_start_s is not None and args.replica_start_s < 0,
            "--replica-start-s must be >= 0",
        ),
        (
            args.search and args.replicas is not None,
            "--search chooses the replica count: drop --replicas",
        ),
    ]
    twin = args.replay_steps or args.from_url
    source = "--replay-steps" if args.replay_steps else "--from-url"
    window = (
        args.window_start != 0.0
        or args.duration is not None
        or args.rate_scale != "1"
        or args.length_scale != 1.0
        or args.class_mix is not None
        or args.default_class != "standard"
    )
    ignored += [
        (
            twin and window,
            f"{source} replays the logged requests: the trace-window flags do not apply",
        ),
        (
            twin and (args.search or args.ablate or args.plots),
            f"{source} runs one plan: drop --search, --ablate and --plots",
        ),
        (twin and args.gpu, f"{source} fits the logged steps: --gpu does not apply"),
        (
            twin
            and any(
                getattr(args, k, None) is not None
                for k in ("lora_token_s", "lora_step_s", "lora_adapter_s")
            ),
            f"{source} replays requests without adapters: --lora-token-s, --lora-step-s "
            "and --lora-adapter-s do not apply",
        ),
        (twin and args.autoscale, f"{source} replays one fleet: --autoscale does not apply"),
        (args.last is not None and not args.from_url, "--last goes with --from-url"),
        (args.last is not None and args.last <= 0, "--last must be > 0 seconds"),
    ]
    for wrong, why in ignored:
        if wrong:
            raise ValueError(why)
    if args.tensor_parallel < 1:
        raise ValueError("--tensor-parallel must be >= 1")
    if args.search:
        args.max_replicas = MAX_REPLICAS if args.max_replicas is None else args.max_replicas
        if args.max_replicas < 1:
            raise ValueError("--max-replicas must be >= 1")
    if args.json and not writable_file(args.json):
        raise ValueError(f"--json {args.json}: not a file in a writable directory")
    plots = Path(args.plots or ".")
    if args.plots and not (
        plots.is_dir() and os.access(plots, os.W_OK) or not plots.exists() and writable_file(plots)
    ):
        raise ValueError(f"--plots {args.plots}: not a writable directory")


def check_classes(args: argparse.Namespace, config: ServiceConfig) -> None:
    """Raises:
    ValueError: --class-mix or --default-class names a class the config lacks.
    """
    known = config.traffic_classes()
    for name in [args.default_class, *(n for n, _ in parse_mix(args.class_mix))]:
        if name not in known:
            raise ValueError(
                f"unknown traffic class {name!r} (known: {sorted(known)}; "
                "a new one needs its fields in --config)"
            )


def run_command(args: argparse.Namespace) -> int:
    from deploy.sim.report import ATTAINMENT, all_classes_meet, plot, table

    check_args(args)
    if args.replay_steps or args.from_url:
        from deploy.sim import twin
        from engine.core.step_log import StepLog

        if args.replay_steps:
            log = StepLog.read(args.replay_steps)
        else:
            log = twin.fetch_log(args.from_url, args.api_key, args.last)
        config = service_config(args, twin.base_config(args.config, log))
        return (twin.replay_command if args.replay_steps else twin.from_url_command)(
            args, log, config
        )
    config, cost = service_config(args), cost_model(args)
    check_classes(args, config)
    print(f"cost model: {cost_line(args, cost)}")
    specs = [trace_spec(args, k) for k in rates(args)]
    if args.search or args.ablate:
        from deploy.sim.search import ablate_command, search_command

        return (search_command if args.search else ablate_command)(args, config, cost, specs)
    from deploy.sim.runs import simulate

    autoscaling = None
    if args.autoscale:
        from deploy.sim.autoscale import autoscaling_for

        config, autoscaling = autoscaling_for(config, args.max_replicas, args.replica_start_s)
    runs, summaries = [], []
    for spec in specs:
        k = spec.rate_scale
        t0 = time.perf_counter()
        run, summary = simulate(
            config, cost, spec, args.routing, args.seed, autoscaling and autoscaling()
        )
        summary["rate_scale"], summary["wall_s"] = k, time.perf_counter() - t0
        runs.append((k, run))
        summaries.append(summary)
        fleet = (
            f"{config.num_replicas} replica(s)"
            if autoscaling is None
            else "autoscaled, "
            f"{summary['replica_hours']:.2f} replica-hours, {len(run.decisions)} scaling actions"
        )
        print(f"\n## rate x{k:g}: {fleet}, simulated in {summary['wall_s']:.1f} s\n")
        print(table(summary))
        if autoscaling is not None:
            from deploy.sim.autoscale import decisions_text

            print(f"\ndecisions (virtual time, target, reason):\n{decisions_text(run.decisions)}")
    report: dict[str, Any] = {
        "trace": trace_info(args),
        "config": config.model_dump(mode="json"),
        "cost_model": describe(cost),
        "runs": summaries,
    }
    if len(summaries) > 1:
        good = [s["offered_rps"] for s in summaries if all_classes_meet(s)]
        report["goodput_rps"] = max(good, default=None)
        best = f"{report['goodput_rps']:.3f} req/s" if good else "none of these rates"
        print(f"\ngoodput (every class >= {ATTAINMENT:.0%} attainment): {best}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plots:
        for path in plot(runs, summaries, args.plots):
            print(f"wrote {path}")
    return 0


def cost_line(args: argparse.Namespace, cost) -> str:
    """Which step-time model the figures come from, for the terminal: a CPU fit is only
    right for the host (and the load on it) it was measured on."""
    terms = [getattr(cost, k, 0) for k in ("lora_adapter_s", "lora_token_s", "lora_step_s")]
    lora = (
        f"; LoRA adapters {terms[0]:g} s per adapter + {terms[1]:g} s per token per "
        f"adapter + {terms[2]:g} s per step"
        if any(terms)
        else ""
    )
    if args.gpu:
        return (
            f"roofline, {args.model_size} on {args.gpu} x {args.tensor_parallel} "
            f"(deploy/sim/hardware.py){lora}"
        )
    origin = args.cost_model or f"the shipped {DEFAULT_COST_MODEL}"
    hint = (
        ""
        if args.cost_model
        else ("; `iterserve calibrate --output FILE` fits this host, `--cost-model FILE` uses it")
    )
    return f"{origin} ({cost.source or 'no source recorded'}){lora}{hint}"


def calibrate_command(args: argparse.Namespace) -> int:
    from deploy.sim.calibrate import CONCURRENCY, calibrate
    from engine.config import EngineConfig

    if args.from_url:
        if args.model is not None or args.steps_per_level is not None:
            raise ValueError(
                "--model and --steps-per-level go with the sweep; --from-url fits the "
                "server's own steps"
            )
        from deploy.sim.twin import calibrate_from_url

        return calibrate_from_url(args)
    if args.last is not None:
        raise ValueError("--last goes with --from-url")
    args.steps_per_level = 40 if args.steps_per_level is None else args.steps_per_level

    if not writable_file(args.output):  # before two minutes of sweep, not after
        raise ValueError(f"--output {args.output}: not a file in a writable directory")
    print(
        f"calibrating: {len(CONCURRENCY)} concurrency levels x {args.steps_per_level} "
        "steps of the real engine",
        file=sys.stderr,
    )
    cost, summary = calibrate(
        EngineConfig(model=args.model),
        args.steps_per_level,
        progress=lambda m: print(m, file=sys.stderr),
    )
    cost.save(args.output)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
