"""``iterserve batch run`` / ``python -m deploy.batch``: an OpenAI batch file, offline.

Reads ``--input`` (:mod:`deploy.batch_format`), skips every ``custom_id`` already in
``--output``, answers bad lines with error records, and runs the rest either on engine
replicas (:mod:`deploy.batch_engine`; the default) or through a running service
(``--via-service URL``, :mod:`deploy.batch_service`). Records are appended as they
finish, so their order is completion order; ``--ordered`` also writes
``OUT.ordered.jsonl`` in input order at the end.

Inside ``ray job submit`` the replicas start as Ray actors on the job's cluster, and on the
cluster at ``--address`` where one is named. Elsewhere one replica runs in this process
without Ray; ``--num-replicas`` above 1 starts a local Ray cluster for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from deploy.batch_format import (
    BatchLine,
    OutputFile,
    error_record,
    read_input,
    record,
)
from deploy.batch_service import ServiceGaveUp
from router.responses import Answer

if TYPE_CHECKING:  # the module itself imports torch: only the engine run loads it
    from deploy.batch_engine import ReplicaPlan

EXIT_UNANSWERED = 3
"""Exit status when ``--via-service`` left requests unanswered (a rerun sends them)."""


ENGINE_FLAGS = (
    "config",
    "model",
    "served_model_name",
    "lora_adapters",
    "num_replicas",
    "replica_num_cpus",
    "replica_num_gpus",
    "max_num_seqs",
    "max_num_batched_tokens",
    "address",
)
"""Flags of the engine-replica run; ``--via-service`` refuses them (it would ignore them)."""


def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The batch command's flags (shared by ``iterserve batch run`` and the module)."""
    p.add_argument("--input", "-i", required=True, help="OpenAI batch file (JSONL)")
    p.add_argument(
        "--output",
        "-o",
        required=True,
        help="results (JSONL), appended; a rerun skips the custom_ids it holds",
    )
    p.add_argument(
        "--ordered",
        action="store_true",
        help="also write OUTPUT.ordered.jsonl in input order at the end",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="a service config (the YAML `iterserve serve --config` reads): its "
        "model, served_model_name, num_replicas, replica_num_cpus/gpus and "
        "engine section as written; flags win",
    )
    p.add_argument(
        "--model",
        default=None,
        help="transformers directory or .gguf file (default: embedded SmolLM2-135M)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the `model` the lines name (default: the model's name)",
    )
    p.add_argument(
        "--lora-adapters",
        metavar="NAME=PATH",
        nargs="+",
        default=None,
        help="LoRA adapters (PEFT directories) that lines may name as `model` (default: "
        "the config's lora_adapters)",
    )
    p.add_argument(
        "--num-replicas",
        type=positive(int),
        default=None,
        help="engine replicas (default: on a cluster, as many as it can place; "
        "else 1, in this process)",
    )
    p.add_argument(
        "--replica-num-cpus",
        type=positive(float),
        default=None,
        help="CPUs per replica; torch uses as many threads (default: a node's; "
        "1 with --replica-num-gpus)",
    )
    p.add_argument(
        "--replica-num-gpus",
        type=positive(float),
        default=None,
        help="GPUs per replica (default: none)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive(int),
        default=None,
        help="running requests per engine step (default: the offline engine's, "
        "engine.llm.OFFLINE_MAX_NUM_SEQS)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive(int),
        default=None,
        help="token budget of one step (default: the offline engine's, "
        "engine.llm.OFFLINE_MAX_NUM_BATCHED_TOKENS)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster (default: the job's cluster; else none for one replica, a "
        "local one for more)",
    )
    p.add_argument(
        "--via-service",
        metavar="URL",
        default=None,
        help="send the lines to a running iterserve service instead",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive(int),
        default=None,
        help="--via-service: requests in flight at most (default: 8)",
    )


class _Progress:
    """The tqdm bar: records done, output tokens/s, time left; and the final counts."""

    def __init__(self, out: OutputFile, total: int) -> None:
        self.out = out
        self.bar = tqdm(
            total=total,
            unit="req",
            desc="batch",
            mininterval=1.0,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.start = time.monotonic()
        self.tokens = 0
        self.errors = 0

    def write(self, rec: dict, tokens: int = 0) -> None:
        self.out.write(rec)
        self.tokens += tokens
        self.errors += rec["error"] is not None
        self.bar.set_postfix_str(f"{self.tokens / self.elapsed:.1f} out tok/s", refresh=False)
        self.bar.update(1)

    def answered(self, cid: str, answer: Answer) -> None:
        self.write(
            record(cid, answer.status, answer.request_id, answer.body), answer.completion_tokens
        )

    def restart(self) -> None:
        """Count time and rates from now (the replicas' start-up is not batch work)."""
        done = self.bar.n
        self.bar.reset()
        self.bar.update(done)
        self.start = time.monotonic()

    @property
    def elapsed(self) -> float:
        return max(1e-9, time.monotonic() - self.start)


CONFIG_FLAGS = (
    "model",
    "served_model_name",
    "num_replicas",
    "replica_num_cpus",
    "replica_num_gpus",
    "lora_adapters",
)
"""ServiceConfig fields that ``--config`` fills in for flags not given."""


def apply_config(args: argparse.Namespace) -> dict[str, Any]:
    """Fill :data:`CONFIG_FLAGS` not given on the command line from ``--config``; return
    the file's ``engine`` section as written (not merged over the server's scheduling
    defaults: a batch runs for throughput unless the file says otherwise).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a valid service config (pydantic's error names the field).
    """
    if args.config is None:
        return {}
    import yaml

    from deploy.config import ServiceConfig

    try:
        ServiceConfig.load(args.config)
    except yaml.YAMLError as e:
        raise ValueError(f"{args.config}: {e}") from e
    data = yaml.safe_load(Path(args.config).read_text()) or {}
    if data.get("num_replicas") == "auto" or data.get("autoscaling") is not None:
        # A batch has no live traffic to scale on: `auto` means as many replicas as the
        # cluster fits, as an unset count does.
        data.pop("num_replicas", None)
    for key in CONFIG_FLAGS:
        if getattr(args, key) is None and data.get(key) is not None:
            setattr(args, key, data[key])
    return dict(data.get("engine") or {})


def _engine_config(args: argparse.Namespace, section: dict[str, Any]) -> dict:
    from engine import EngineConfig
    from engine.llm import OFFLINE_DEFAULTS

    fields = {
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    return EngineConfig(**{**OFFLINE_DEFAULTS, **section, **given}).model_dump()


def lora_adapters(args: argparse.Namespace) -> dict[str, str]:
    """The adapters of ``--lora-adapters NAME=PATH ...`` (a list) or the config's (a
    mapping).

    Raises:
        ValueError: an entry without ``=``.
    """
    given = args.lora_adapters or {}
    if isinstance(given, dict):
        return dict(given)
    out = {}
    for entry in given:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-adapters {entry!r}: expected NAME=PATH")
        out[name] = path
    return out


def _model_name(args: argparse.Namespace) -> str:
    from deploy.config import ServiceConfig

    return ServiceConfig(model=args.model, served_model_name=args.served_model_name).model_name()


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags the chosen way of running would ignore.

    Raises:
        ValueError: engine flags with ``--via-service``, or ``--max-concurrency``
            without it.
    """
    if args.via_service:
        given = [f"--{f.replace('_', '-')}" for f in ENGINE_FLAGS if getattr(args, f) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: these set up engine replicas, which "
                "--via-service does not start (the service has its own)"
            )
    elif args.max_concurrency is not None:
        raise ValueError(
            "--max-concurrency applies to --via-service only; engine replicas "
            "are kept 2 * max_num_seqs deep"
        )


def _run_engine(args: argparse.Namespace, todo: list[BatchLine], progress: _Progress) -> None:
    engine = _engine_config(args, apply_config(args))
    work = [(line.custom_id, line.url, line.body) for line in todo]
    # Not inside a job and no --address: this machine alone, never the cluster that an
    # `iterserve serve` on it runs, whose CPUs its replicas already hold.
    local = args.address is None and "RAY_ADDRESS" not in os.environ
    if local and (args.num_replicas or 1) == 1:
        _run_here(args, engine, work, progress)
    else:
        _run_on_ray(args, engine, work, progress, local)


def _starting(progress: _Progress, plan: ReplicaPlan, where: str) -> None:
    progress.bar.write(
        f"iterserve batch: starting {plan.num_replicas} replica(s) of "
        f"{plan.num_cpus:g} CPUs, {plan.num_gpus:g} GPUs {where}",
        file=sys.stderr,
    )


def _run_here(
    args: argparse.Namespace, engine: dict[str, Any], work: list[tuple], progress: _Progress
) -> None:
    from deploy.batch_engine import BatchWorker, plan_local, run_on_replicas

    plan = plan_local(args.replica_num_cpus, args.replica_num_gpus or 0.0)
    _starting(progress, plan, "in this process")
    replica = BatchWorker(
        engine, _model_name(args), max(1, int(plan.num_cpus)), lora_adapters(args)
    )

    async def run() -> None:
        try:
            await run_on_replicas([replica], work, progress.answered)
        finally:
            await replica.engine.shutdown()

    progress.restart()
    asyncio.run(run())


def _run_on_ray(
    args: argparse.Namespace,
    engine: dict[str, Any],
    work: list[tuple],
    progress: _Progress,
    local: bool,
) -> None:
    import ray

    from deploy.batch_engine import plan_replicas, run_on_replicas, start_replicas

    # A local cluster of this run's own ("local"), unless a cluster was named.
    kwargs = (
        {"address": "local", "include_dashboard": False} if local else {"address": args.address}
    )
    ray.init(logging_level=logging.WARNING, **kwargs)
    try:
        plan = plan_replicas(args.num_replicas, args.replica_num_cpus, args.replica_num_gpus or 0.0)
        _starting(progress, plan, "as Ray actors")
        replicas = start_replicas(plan, engine, _model_name(args), lora_adapters(args))
        progress.restart()
        asyncio.run(run_on_replicas(replicas, work, progress.answered))
    finally:
        ray.shutdown()


def _run_service(args: argparse.Namespace, todo: list[BatchLine], progress: _Progress) -> None:
    from deploy.batch_service import DEFAULT_CONCURRENCY, run_via_service

    work = [(line.custom_id, line.url, line.body) for line in todo]
    asyncio.run(
        run_via_service(
            args.via_service,
            work,
            progress.answered,
            concurrency=args.max_concurrency or DEFAULT_CONCURRENCY,
        )
    )


def run(args: argparse.Namespace) -> int:
    """Run the batch; 0 once every input line has its record in ``args.output``.

    Raises:
        BatchFileError: missing or repeated ``custom_id``s, or an output file that is not
            this input's (nothing is run).
        ValueError: flags the chosen way of running would ignore (:func:`check_flags`).
    """
    check_flags(args)
    lines = read_input(args.input)
    out = OutputFile(args.output, {line.custom_id for line in lines})
    if out.repaired_bytes:
        print(
            f"iterserve batch: removed a torn last line ({out.repaired_bytes} bytes) from "
            f"{args.output}",
            file=sys.stderr,
        )
    todo = [line for line in lines if line.custom_id not in out.done]
    print(
        f"iterserve batch: {len(lines)} lines in {args.input}, {len(lines) - len(todo)} "
        f"already in {args.output}, {len(todo)} to run",
        file=sys.stderr,
    )
    progress = _Progress(out, len(todo))
    status = 0
    try:
        for line in todo:
            if line.error is not None:
                progress.write(error_record(line.custom_id, line.error))
        todo = [line for line in todo if line.error is None]
        if todo:
            runner = _run_service if args.via_service else _run_engine
            runner(args, todo, progress)
    except ServiceGaveUp as e:
        print(f"\niterserve batch: {e}", file=sys.stderr)
        status = EXIT_UNANSWERED
    finally:
        progress.bar.close()
        out.close()
    if args.ordered and status == 0:
        print(f"iterserve batch: input order in {out.write_ordered(lines)}", file=sys.stderr)
    print(
        f"iterserve batch: wrote {progress.bar.n} records ({progress.errors} errors) in "
        f"{progress.elapsed:.1f} s, {progress.tokens / progress.elapsed:.1f} output tok/s; "
        f"{args.output} holds {len(out.done)} of {len(lines)}",
        file=sys.stderr,
    )
    return status


def run_command(args: argparse.Namespace) -> int:
    """:func:`run` with its failures as exit statuses and one-line messages."""
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"iterserve batch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\niterserve batch: interrupted; {args.output} keeps what finished: rerun the "
            "same command to run the rest",
            file=sys.stderr,
        )
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
