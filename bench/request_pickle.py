"""What a request's sampling parameters cost to send from the ingress to a Ray Serve replica:
the typed :class:`engine.core.params.SamplingParams` against the 18-key dict the router sent
before it.

Run from the repository root (a few seconds)::

    python -m bench.request_pickle            # writes bench/results/experiments/request_pickle.json

Ray Serve pickles a replica call's arguments (cloudpickle, protocol 5; a class importable by
name is pickled by reference, as :mod:`pickle` does). For each representative request and
each form, per request: the pickled size in bytes, and the microseconds of ``dumps`` then
``loads``, with :mod:`pickle` and with Ray's cloudpickle. The replica's side too: ``loads``
and, for the dict, the ``SamplingParams(**params)`` the replica then built (and so checked)
from it; the typed form arrives built. Timings: ``--rounds`` rounds, the forms in
alternating order, each round timing ``--number`` requests back to back; the table gives the
median over rounds and the spread (min-max).
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.toolkit import cli
from bench.toolkit import report as rp
from engine.core.params import RequestOutputKind, SamplingParams
from router import openai_format as fmt
from router.schemas import ApiRequest, ChatCompletionRequest, CompletionRequest

OUT = Path(__file__).resolve().parent / "results" / "experiments" / "request_pickle.json"

REQUESTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "chat": (
        True,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 256,
            "temperature": 0.7,
            "top_p": 0.95,
            "stream": True,
        },
    ),
    "completion, rich": (
        False,
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 128,
            "temperature": 0.8,
            "seed": 1234,
            "stop": ["\n\n", "###"],
            "logit_bias": {"42": -5, "1000": 2.5, "7": -100},
            "stop_token_ids": [2],
            "logprobs": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "answer",
                    "schema": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                        "required": ["name"],
                    },
                },
            },
        },
    ),
}
"""Name -> (chat, the request body)."""


def dict_params(req: ApiRequest, chat: bool) -> dict[str, Any]:
    """The 18 keys ``router.openai_format.sampling_params`` returned before it built
    :class:`SamplingParams` (the form the router sent to a replica)."""
    if chat:
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = None if req.max_tokens is None else max(1, req.max_tokens)
        logprobs = req.logprobs
    echo_logprobs = not chat and req.echo and req.logprobs is not None
    return {
        "max_tokens": max_tokens,
        "prompt_logprobs": req.logprobs if echo_logprobs else None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k if req.top_k is not None else 0,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": req.logit_bias or {},
        "min_tokens": req.min_tokens,
        "stop_token_ids": req.stop_token_ids or [],
        "json_schema": req.response_format.output_schema() if req.response_format else None,
        "n": req.n,
        "stop": req.stop or [],
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
    }


def _round_trip(mod: Any, obj: object) -> object:
    return pickle.loads(mod.dumps(obj, protocol=5))


def _per_request_us(fn: Callable[[Any, Any], object], a: Any, b: Any, number: int) -> float:
    """Microseconds per call of ``fn(a, b)``, over ``number`` calls back to back."""
    start = time.perf_counter_ns()
    for _ in range(number):
        fn(a, b)
    return (time.perf_counter_ns() - start) / number / 1e3


def _replica_side(build: Callable[[object], object], wire: bytes) -> object:
    return build(pickle.loads(wire))


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median_us": statistics.median(xs), "min_us": min(xs), "max_us": max(xs)}


def measure(rounds: int, number: int) -> list[dict[str, Any]]:
    """One row per request and form: sizes and timings (see the module docstring)."""
    from ray import cloudpickle

    picklers = {"pickle": pickle, "cloudpickle": cloudpickle}
    rows = []
    for name, (chat, body) in REQUESTS.items():
        req = fmt.validate(body, ChatCompletionRequest if chat else CompletionRequest)
        typed = fmt.sampling_params(req, chat)
        forms: dict[str, tuple[object, Callable[[object], object]]] = {
            "dict (before)": (
                dict_params(req, chat),
                lambda p: SamplingParams(**p, output_kind=RequestOutputKind.DELTA),
            ),
            "SamplingParams": (typed, lambda p: p),
        }
        assert forms["dict (before)"][1](forms["dict (before)"][0]) == typed
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            order = list(forms) if r % 2 == 0 else list(reversed(forms))
            for form in order:
                obj, build = forms[form]
                for pname, mod in picklers.items():
                    wire = mod.dumps(obj, protocol=5)
                    times.setdefault((form, pname), []).append(
                        _per_request_us(_round_trip, mod, obj, number)
                    )
                    times.setdefault((form, pname + " replica"), []).append(
                        _per_request_us(_replica_side, build, wire, number)
                    )
        for form, (obj, _) in forms.items():
            rows.append(
                {
                    "request": name,
                    "form": form,
                    "bytes": {p: len(m.dumps(obj, protocol=5)) for p, m in picklers.items()},
                    "dumps_loads": {p: _summary(times[(form, p)]) for p in picklers},
                    "replica_loads_and_build": {
                        p: _summary(times[(form, p + " replica")]) for p in picklers
                    },
                }
            )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """The result as a markdown table (µs per request: median over rounds, min-max)."""

    def us(s: dict[str, float]) -> str:
        return f"{s['median_us']:.2f} ({s['min_us']:.2f}-{s['max_us']:.2f})"

    header = [
        "request",
        "form",
        "bytes (pickle / cloudpickle)",
        "dumps+loads µs, pickle",
        "dumps+loads µs, cloudpickle",
        "replica: loads (+ build) µs",
    ]
    lines = [
        [
            r["request"],
            r["form"],
            f"{r['bytes']['pickle']} / {r['bytes']['cloudpickle']}",
            us(r["dumps_loads"]["pickle"]),
            us(r["dumps_loads"]["cloudpickle"]),
            us(r["replica_loads_and_build"]["pickle"]),
        ]
        for r in rows
    ]
    return rp.table(header, lines, "ll" + "r" * 4)


def main(argv: list[str] | None = None) -> None:
    ap = cli.parser("bench.request_pickle", __doc__)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--number", type=int, default=2000, help="requests timed per round")
    cli.add_out(ap, OUT, "the result file", type=Path)
    args = ap.parse_args(argv)
    rows = measure(args.rounds, args.number)
    report = {
        "load_avg_1m": os.getloadavg()[0],
        "rounds": args.rounds,
        "number": args.number,
        "requests": {name: body for name, (_, body) in REQUESTS.items()},
        "results": rows,
    }
    rp.write_report(args.out, report, render(rows), md_file=False)


if __name__ == "__main__":
    main()
