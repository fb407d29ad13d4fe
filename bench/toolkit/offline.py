"""The offline engines the suites compare, and what is measured around them: iterserve and
vLLM's CPU build (:class:`Engine`, the same four measurements for both, for
:mod:`bench.peers`), and transformers' ``model.generate`` on static batches and continuous
batching (:func:`worker_hf_generate`, :func:`worker_hf_generate_batch`, each run in its own
subprocess by :mod:`bench.engine_throughput`, beside its iterserve worker). Both suites build
iterserve's and vLLM's requests with :func:`greedy_requests` and check every output's length;
the throughput workers measure their timed section with :class:`Timed` and hand back
:func:`make_result`.

Run in the venv of the engine it measures, from the repository root, by
:class:`bench.toolkit.servers.OfflineEngine` (``python -m bench.peers`` runs both)::

    .venv/bin/python -m bench.toolkit.offline --engine iterserve --model DIR
    .venv-vllm/bin/python -m bench.toolkit.offline --engine vllm --model DIR

This module and what it imports at the top (:mod:`bench.toolkit.cli`,
:mod:`bench.toolkit.workload`, :mod:`bench.toolkit.cpu_load`) need only the standard library,
so vLLM's venv runs it; torch, transformers and the engines are imported where used.

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
import resource
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from bench.toolkit import cli
from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores
from bench.toolkit.workload import Lengths, read_trace


# What every offline measurement records: wall time, CPU load, memory, the result.
def peak_rss_mib() -> float:
    """Peak resident set of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def rss_mib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


class Timed:
    """Context manager: wall seconds and other processes' CPU load over a timed section."""

    def __enter__(self):
        self.snap = cpu_snapshot()
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t
        end = cpu_snapshot()
        self.foreign = foreign_cores(self.snap, end, self.wall)
        # cores this process kept busy (all its threads): how parallel the system really ran
        self.own = (end[1] - self.snap[1]) / self.wall if self.snap and end else None
        return False


def set_threads(cfg: dict) -> None:
    import torch

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])


def make_result(wl: dict, wall: float, tokens: list[list[int]], **extra) -> dict:
    """A worker's result: throughput over ``wall``, after checking every request got exactly
    its output length."""
    lens = wl["output_lens"]
    bad = [i for i, (t, n) in enumerate(zip(tokens, lens)) if len(t) != n]
    if bad:
        i = bad[0]
        raise RuntimeError(
            f"{len(bad)} requests got the wrong number of tokens "
            f"(request {i}: {len(tokens[i])} instead of {lens[i]})"
        )
    out_tok = sum(lens)
    prompt_tok = sum(len(p) for p in wl["prompts"])
    return {
        "wall_s": wall,
        "output_tokens": out_tok,
        "prompt_tokens": prompt_tok,
        "output_tok_s": out_tok / wall,
        "total_tok_s": (out_tok + prompt_tok) / wall,
        "token_ids": tokens,
        **extra,
    }


# transformers: model.generate on static batches, and continuous batching.
def _load_hf(attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)  # the same directory as llm.llm_engine.model_dir
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return model, tok, model_dir


def worker_hf_generate(wl: dict, cfg: dict) -> dict:
    import torch
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    model, tok, model_dir = _load_hf()
    setup = time.perf_counter() - t0
    rss_loaded = rss_mib()
    pad = tok.eos_token_id  # prompts are left-padded by hand below, with an attention mask
    # ignore_eos: with eos_token_id None nothing stops on EOS and nothing suppresses it (a None
    # in the GenerationConfig passed to generate is filled from the model's, hence this).
    model.generation_config.eos_token_id = None

    def run_batch(prompts: list[list[int]], n_new: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gc = GenerationConfig(
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        new = out[:, width:]
        if new.shape[1] != n_new:
            raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {n_new}")
        return new.tolist()

    run_batch([p[:32] for p in wl["prompts"][:2]], 4)  # warm-up

    B = cfg["batch_size"]
    prompts, lens = wl["prompts"], wl["output_lens"]
    tokens: list[list[int]] = []
    computed = 0
    with Timed() as tm:
        for s in range(0, len(prompts), B):
            n_new = max(lens[s : s + B])
            rows = run_batch(prompts[s : s + B], n_new)
            computed += n_new * len(rows)
            tokens.extend(r[:n] for r, n in zip(rows, lens[s : s + B]))
    return make_result(
        wl,
        tm.wall,
        tokens,
        setup_s=setup,
        rss_after_load_mib=rss_loaded,
        foreign_cores=tm.foreign,
        own_cores=tm.own,
        output_tokens_computed=computed,
        model_dir=str(model_dir),
    )


# --------------------------------------------------------------------------------------------
# Continuous batching
# --------------------------------------------------------------------------------------------


def _resolved_cb(mgr) -> dict:
    """What transformers actually built from our ContinuousBatchingConfig."""
    c = mgr.continuous_batching_config
    out = {
        k: getattr(c, k, None)
        for k in (
            "page_size",
            "num_blocks",
            "max_batch_tokens",
            "max_requests_per_batch",
            "max_blocks_per_request",
            "max_memory_percent",
            "use_async_batching",
            "use_cuda_graph",
            "allow_block_sharing",
            "scheduler_type",
        )
    }
    cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
    if cache is not None:
        out["cache_num_blocks"] = getattr(cache, "num_blocks", None)
        out["cache_max_batch_tokens"] = getattr(cache, "max_batch_tokens", None)
        tensor = getattr(cache, "cache_tensor", None)
        if tensor is not None:
            out["cache_tensor_mib"] = tensor.numel() * tensor.element_size() / 2**20
    out["attn_implementation"] = mgr.model.config._attn_implementation
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


def _cb_config(cfg: dict):
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=cfg["page_size"],
        num_blocks=cfg["num_blocks"],
        max_batch_tokens=cfg["max_batch_tokens"],
        max_requests_per_batch=cfg["max_requests_per_batch"],
        allow_block_sharing=cfg["allow_block_sharing"],
        auto_switch_to_flash=cfg["auto_switch_to_flash"],
        scheduler_type=cfg["scheduler_type"],
        default_compile_level=cfg["default_compile_level"],
    )


def _gen_config(n_new: int, pad: int):
    from transformers import GenerationConfig

    # eos_token_id=-1: EOS never matches, so it neither stops nor is suppressed
    return GenerationConfig(
        max_new_tokens=n_new, do_sample=False, eos_token_id=-1, pad_token_id=pad
    )


def _via_generate_batch(model, cfg: dict, pad: int, ps: list[list[int]], n_new: int):
    """``model.generate_batch`` on ``ps``, ``n_new`` tokens each: (tokens, timed section)."""
    with Timed() as tm:  # includes the manager's set-up and warm-up
        res = model.generate_batch(
            inputs=ps,
            generation_config=_gen_config(n_new, pad),
            continuous_batching_config=_cb_config(cfg),
        )
    out = list(res.values())
    if len(out) != len(ps) or any(r.error for r in out):
        errs = [r.error for r in out if r.error]
        raise RuntimeError(f"generate_batch returned {len(out)}/{len(ps)} results; {errs[:1]}")
    return [list(r.generated_tokens) for r in out], tm


def _collect(mgr, ids: list[str]) -> dict:
    """Wait for the manager's results of ``ids``: request id -> finished result."""
    done: dict = {}
    while len(done) < len(ids):
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
            done[r.request_id] = r
        elif r is None and not mgr.is_running():
            raise RuntimeError(
                f"continuous batching thread stopped with {len(done)}/{len(ids)} requests done"
            )
    return done


def _via_manager(model, cfg: dict, pad: int, ps: list[list[int]], ns: list[int], resolved: dict):
    """The manager ``generate_batch`` builds, one request per prompt with its own length:
    (tokens, timed section, manager set-up s); ``resolved`` gets :func:`_resolved_cb`."""
    import torch

    with torch.inference_mode():
        t = time.perf_counter()
        with model.continuous_batching_context_manager(
            generation_config=_gen_config(max(ns), pad),
            continuous_batching_config=_cb_config(cfg),
            block=True,
            timeout=30,
        ) as mgr:
            setup = time.perf_counter() - t
            resolved.update(_resolved_cb(mgr))
            with Timed() as tm:  # ends before the manager's stop/join
                ids = [
                    mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                    for i, (p, n) in enumerate(zip(ps, ns))
                ]
                done = _collect(mgr, ids)
    return [list(done[i].generated_tokens) for i in ids], tm, setup


def worker_hf_generate_batch(wl: dict, cfg: dict) -> dict:
    # Imported before the clock starts, as in worker_hf_generate: setup_s leaves out the import
    # of transformers; the helpers above import the same names again, from sys.modules.
    from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: F401

    t0 = time.perf_counter()
    model, tok, model_dir = _load_hf()
    rss_loaded = rss_mib()
    prompts, lens = wl["prompts"], wl["output_lens"]
    pad = tok.eos_token_id
    resolved: dict = {}
    warm = [p[:32] for p in prompts[:2]]
    if cfg["api"] == "generate_batch":
        _via_generate_batch(model, cfg, pad, warm, 4)
        setup = time.perf_counter() - t0
        n_new = max(lens)
        rows, tm = _via_generate_batch(model, cfg, pad, prompts, n_new)
        tokens = [r[:n] for r, n in zip(rows, lens)]
        extra = {
            "output_tokens_computed": n_new * len(prompts),
            "note": "wall includes generate_batch's manager set-up and warm-up",
        }
    else:
        _via_manager(model, cfg, pad, warm, [4, 4], resolved)
        load = time.perf_counter() - t0
        tokens, tm, mgr_setup = _via_manager(model, cfg, pad, prompts, lens, resolved)
        setup = load + mgr_setup
        extra = {"manager_setup_s": mgr_setup, "resolved_config": resolved}
    return make_result(
        wl,
        tm.wall,
        tokens,
        setup_s=setup,
        rss_after_load_mib=rss_loaded,
        foreign_cores=tm.foreign,
        own_cores=tm.own,
        model_dir=str(model_dir),
        **extra,
    )


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
