"""The ``iterserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(  # first: a bad flag should not wait for the model to load
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or [],
    )
    llm = LLM(model=args.model)
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    print(args.prompt + completion.text if not args.chat else completion.text)
    m = out.metrics
    print(
        f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}, "
        f"TTFT {m.first_token_time - m.arrival_time:.2f} s, "
        f"E2E {m.finish_time - m.arrival_time:.2f} s]",
        file=sys.stderr,
    )
    return 0


def _replicas(text: str) -> int | str:
    """``--num-replicas``: a count, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of replicas or `auto`") from None


def _serve(args: argparse.Namespace) -> int:
    from deploy.config import ServiceConfig

    config = ServiceConfig.load(
        args.config,
        model=args.model,
        num_replicas=args.num_replicas,
        host=args.host,
        port=args.port,
        step_log=args.step_log,
        max_queue_time_s=args.max_queue_time_s,
        stream_keepalive_s=args.stream_keepalive_s,
        engine={"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype},
    )
    from deploy.server import run_server

    return run_server(config, address=args.address)


def _dashboard_push(args: argparse.Namespace) -> int:
    from deploy.dashboard import GrafanaError
    from deploy.dashboard import main as push

    try:
        return push(args)
    except GrafanaError as e:
        print(f"iterserve: Grafana at {args.grafana_url} refused: {e}", file=sys.stderr)
        return 1


def _top(args: argparse.Namespace) -> int:
    import httpx

    from deploy.top import run

    try:
        return run(args.url, once=args.once, interval_s=args.interval)
    except httpx.HTTPError as e:
        print(f"iterserve: cannot read {args.url}/metrics: {e}", file=sys.stderr)
        return 1


def _batch_run(args: argparse.Namespace) -> int:
    from deploy.batch import run_command

    return run_command(args)


def _simulate(args: argparse.Namespace) -> int:
    from deploy.sim.cli import run_command

    return run_command(args)


def _calibrate(args: argparse.Namespace) -> int:
    from deploy.sim.cli import calibrate_command

    return calibrate_command(args)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    srv.add_argument(
        "--model",
        default=None,
        help="transformers directory or .gguf file (default: embedded SmolLM2-135M)",
    )
    srv.add_argument(
        "--num-replicas",
        type=_replicas,
        default=None,
        help="model replicas (default 1), or `auto`: scale on the SLOs between the config's "
        "autoscaling bounds (default 1 to this host's CPUs / replica_num_cpus)",
    )
    srv.add_argument("--host", default=None, help="HTTP host (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    srv.add_argument(
        "--config", default=None, help="YAML ServiceConfig; flags given here override it"
    )
    srv.add_argument(
        "--max-queue-time-s",
        type=float,
        default=None,
        help="seconds a request may wait for its first token before it is refused "
        "(default 30; a class with a longer TTFT SLO waits up to that)",
    )
    srv.add_argument(
        "--stream-keepalive-s",
        type=float,
        default=None,
        help="seconds of silence after which a stream sends an SSE comment (default 15)",
    )
    srv.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "int4"),
        default=None,
        help="the engine's weights (engine.quantization): auto keeps a GGUF's quantized "
        "weights packed (default); none de-quantizes them; int8 / int4 quantize a "
        "transformers directory at load",
    )
    srv.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default=None,
        help="the KV cache's element type (engine.kv_cache_dtype; default auto: the model dtype)",
    )
    srv.add_argument(
        "--step-log",
        default=None,
        metavar="FILE",
        help="append every engine step and request event to FILE as JSON lines "
        "(iterserve simulate --replay-steps reads it)",
    )
    srv.add_argument(
        "--address",
        default=None,
        help="a Ray cluster to serve on, or 'local' for an embedded one "
        "(default: one replica runs in this process without Ray; "
        "more replicas start an embedded cluster)",
    )
    srv.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print one completion (a quick look at a model)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--model",
        default=None,
        help="transformers directory or .gguf file (default: embedded SmolLM2-135M)",
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.set_defaults(func=_generate)

    _add_serve(sub)

    top = sub.add_parser("top", help="live view of each class's SLOs, from /metrics")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    from deploy.batch import add_arguments as batch_arguments
    from deploy.batch import positive

    top.add_argument(
        "--interval", type=positive(float), default=2.0, help="seconds between refreshes"
    )
    top.set_defaults(func=_top)

    batch = sub.add_parser("batch", help="offline batches (OpenAI batch files)")
    batch_sub = batch.add_subparsers(dest="action", required=True)
    batch_run = batch_sub.add_parser(
        "run", help="answer every line of a batch file; rerun to resume after a kill"
    )
    batch_arguments(batch_run)
    batch_run.set_defaults(func=_batch_run)

    from deploy.sim.cli import add_arguments as simulate_arguments

    sim = sub.add_parser(
        "simulate",
        help="replay a trace through simulated replicas in "
        "virtual time (the real scheduler and router)",
    )
    simulate_arguments(sim)
    sim.set_defaults(func=_simulate)
    cal = sub.add_parser(
        "calibrate", help="fit the simulator's step-time model to the real engine on this machine"
    )
    cal.add_argument("--output", default="sim_cost.json", help="where to write the fit")
    cal.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    cal.add_argument(
        "--steps-per-level",
        type=int,
        default=None,
        help="steps measured at each concurrency level (default 40)",
    )
    cal.add_argument(
        "--from-url",
        default=None,
        metavar="URL",
        help="fit on a running server's recent steps (GET URL/steps) instead of a sweep",
    )
    from deploy.sim.cli import server_arguments

    server_arguments(cal)
    cal.set_defaults(func=_calibrate)

    dash = sub.add_parser("dashboard", help="the Grafana dashboard")
    dash_sub = dash.add_subparsers(dest="action", required=True)
    push = dash_sub.add_parser("push", help="create or replace it in Grafana")
    push.add_argument("--grafana-url", required=True, help="e.g. http://grafana:3000")
    push.add_argument(
        "--api-key-env",
        required=True,
        help="environment variable holding a Grafana API key or token",
    )
    push.add_argument(
        "--prometheus-url",
        default=None,
        help="also create the Prometheus data source, pointing here",
    )
    push.add_argument("--folder-uid", default=None, help="Grafana folder for the dashboard")
    push.set_defaults(func=_dashboard_push)
    return parser


def _one_line(e: Exception) -> str:
    """A pydantic error as ``field: message`` pairs (its own text spans lines and ends
    in a link); anything else as it is."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'config'}: "
            f"{err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
    return str(e)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input: a clear message, not a traceback
        print(f"iterserve: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\niterserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
