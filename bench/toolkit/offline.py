"""The offline engines :mod:`bench.peers` compares, and what is measured on them: iterserve
and vLLM's CPU build (:class:`Engine`, the same four measurements for both). iterserve's and
vLLM's requests are built by :func:`greedy_requests`, which the throughput workers of
:mod:`bench.toolkit.workers` (iterserve and transformers, for :mod:`bench.engine_throughput`)
share, and every output's length is checked.

Run in the venv of the engine it measures, from the repository root, by
:class:`bench.toolkit.servers.OfflineEngine` (``python -m bench.peers`` runs both)::

    .venv/bin/python -m bench.toolkit.offline --engine iterserve --model DIR
    .venv-vllm/bin/python -m bench.toolkit.offline --engine vllm --model DIR

This module and what it imports at the top (:mod:`bench.toolkit.cli`,
:mod:`bench.toolkit.workload`) need only the standard library, so vLLM's venv runs it;
transformers and the engines are imported where used.

Measurements (greedy, ``ignore_eos``, prompt token ids drawn uniformly from [1000, 40000) by
``random.Random(0)``, fp32, the threads the environment gives: ``OMP_NUM_THREADS``):

- ``trace32``: the first 32 rows of the Azure conversation trace from ``--window-start``
  (Patel et al., "Splitwise", ISCA 2024; CC-BY 4.0), lengths divided by 8 (prompt clamped to
  [4, 1024], output to [1, 512]), all submitted at once: output tokens/s.
- ``stream1`` / ``stream8``: decode cost in ms per step with 1 and 8 running sequences:
  (wall(T output tokens) - wall(1 output token)) / (T - 1), so prefill and call overheads
  cancel out.
- ``prefill``: prompt tokens/s for 16 x 128, 8 x 512 and 32 x 64 prompts, one output token each.

Each measurement is the median of ``--repeats`` (3) after one warm-up call.

The engine is loaded and stays loaded, answering requests from stdin, so that
:mod:`bench.peers` can alternate the two engines' measurements, and measure each right
beside the same engine served over HTTP. Each line on stdin is either
``{"measure": {"warmup": bool}}`` (the four measurements once, with or without a warm-up
call each; ``--repeats`` timed calls) or ``{"streams": n, "tokens": t, "prompt": text}``
(``{"ms_per_step": ...}`` for ``n`` sequences decoding ``t`` tokens from ``text``,
tokenized without special tokens, as the servers do). It answers with one JSON line on
the original stdout after ``{"ready": true}``; everything else the engines print goes to
stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from bench.toolkit import cli
from bench.toolkit.workload import Lengths, read_trace

# iterserve and vLLM: the four measurements, and the probe loop.
PREFILL_SHAPES = ((16, 128), (8, 512), (32, 64))


def trace_requests(path: Path, start: int, n: int, scale: float) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of ``n`` trace rows from ``start``, lengths / ``scale``."""
    lengths = Lengths(scale, scale, 4, 1024, 1, 512)
    return [
        (lengths.prompt(r.context_tokens), lengths.output(r.generated_tokens))
        for r in read_trace(path, start, n)[:n]
    ]


def greedy_requests(
    sampling_cls: type, reqs: Iterable[tuple[list[int], int]], **sampling
) -> tuple[list[dict], list]:
    """The prompts and sampling parameters that iterserve's and vLLM's ``LLM.generate`` take
    for ``reqs`` (prompt token ids, output tokens): greedy (``temperature=0``, unless
    ``sampling`` sets other ``SamplingParams`` fields), ``ignore_eos``, so that every output
    has exactly its length. ``sampling_cls``: the engine's ``SamplingParams``."""
    reqs = list(reqs)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [
        sampling_cls(max_tokens=n, ignore_eos=True, **({"temperature": 0} | sampling))
        for _, n in reqs
    ]
    return prompts, params


class Engine:
    """Runs a list of (prompt ids, max_tokens) requests to completion; returns seconds."""

    def __init__(self, name: str, model: str) -> None:
        self.name = name
        if name == "vllm":
            from vllm import LLM, SamplingParams

            # No prefix caching in either engine: the warm-up and the repeats send the
            # same prompts, so a cache would measure hits rather than the engine.
            self.llm = LLM(
                model=model,
                dtype="float32",
                max_model_len=2048,
                max_num_seqs=64,
                seed=0,
                enable_prefix_caching=False,
            )
        else:
            from engine import LLM, SamplingParams

            self.llm = LLM(model=model, enable_prefix_caching=False)
        self.sampling = SamplingParams

    def run(self, reqs: list[tuple[list[int], int]], **sampling) -> float:
        """``sampling``: SamplingParams fields over greedy (``temperature=0``)."""
        prompts, params = greedy_requests(self.sampling, reqs, **sampling)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [n for _, n in reqs]:
            raise RuntimeError(f"{self.name}: output lengths {got[:8]}... differ from asked")
        return wall


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def median_of(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    return statistics.median(fn() for _ in range(repeats))


def measure(eng: Engine, args: argparse.Namespace, warmup: bool = True) -> dict:
    """The four measurements (module docstring); ``warmup``: one untimed call before each."""
    rng = random.Random(0)
    median = functools.partial(median_of, repeats=args.repeats, warmup=warmup)
    out: dict = {}
    shapes = trace_requests(Path(args.trace), args.window_start, 32, 8)
    reqs = [(ids(rng, p), o) for p, o in shapes]
    wall = median(lambda: eng.run(reqs))
    out["trace32_output_tok_s"] = sum(o for _, o in shapes) / wall
    t = args.decode_tokens
    for n in (1, 8):
        prompts = [ids(rng, 16) for _ in range(n)]
        long = median(functools.partial(eng.run, [(p, t) for p in prompts]))
        short = median(functools.partial(eng.run, [(p, 1) for p in prompts]))
        out[f"stream{n}_ms_per_step"] = 1000 * (long - short) / (t - 1)
    for n, length in PREFILL_SHAPES:
        prompts = [(ids(rng, length), 1) for _ in range(n)]
        wall = median(functools.partial(eng.run, prompts))
        out[f"prefill_{n}x{length}_tok_s"] = n * length / wall
    return out


def decode_ms(eng: Engine, prompts: list[list[int]], tokens: int) -> float:
    """ms per decode step of ``len(prompts)`` sequences over ``tokens`` output tokens:
    (wall(tokens) - wall(1)) / (tokens - 1), so prefill and call overheads cancel out."""
    long = eng.run([(p, tokens) for p in prompts])
    short = eng.run([(p, 1) for p in prompts])
    return 1000 * (long - short) / (tokens - 1)


def probe_loop(eng: Engine, args: argparse.Namespace, answers) -> None:
    """Answer requests from stdin until it closes (see the module docstring)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if "measure" in ask:
            answer = measure(eng, args, warmup=ask["measure"]["warmup"])
        else:
            prompt = tokenizer.encode(ask["prompt"], add_special_tokens=False)
            answer = {"ms_per_step": decode_ms(eng, [prompt] * ask["streams"], ask["tokens"])}
        print(json.dumps(answer), file=answers, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.toolkit.offline", __doc__)
    p.add_argument("--engine", choices=["iterserve", "vllm"], required=True)
    p.add_argument("--model", required=True, help="a transformers directory")
    cli.add_trace(p)
    cli.add_window_start(p, 0)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    # The answers go to the original stdout; the engines' own prints (and their workers') to
    # stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    probe_loop(Engine(args.engine, args.model), args, answers)
    return 0


if __name__ == "__main__":  # vLLM's engine core starts a process by spawn
    sys.exit(main())
