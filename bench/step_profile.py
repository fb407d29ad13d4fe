"""Where one engine step's time goes, packed weights against the fp32 path (``python -m
bench.step_profile``; about 3 minutes).

For each engine (the embedded GGUF with ``quantization: auto``, packed, and ``none``, fp32)
and each step shape, the mean of ``--steps`` steps driven through ``LLMEngine.step``, split
by the engine's own step record (:class:`engine.StepRecord`): the scheduler, the runner's
``prepare`` / ``forward`` / ``sample``, and the rest (request updates, detokenizing,
outputs). The forward is then split by timing its parts alone, back to back on the same
shapes, right after:

* ``products``: every linear layer of the model at the step's row count (the LM head at the
  rows it samples);
* ``attention``: the CPU kernels' decode or prefill attention of every layer on the
  step's context;
* ``rest of forward``: the forward minus those two: norms, RoPE, the cache writes, the
  embedding, and the dispatch between them (Python, ctypes).

Shapes: one sequence decoding (128 tokens of context), 8 sequences decoding, 32 decoding,
and one 512-token prefill chunk. Output: a table and ``bench/results/step_profile.json``
with the run record. Streaming is not in these steps: ``bench.peers``' packed-weights
phase measures the same decode served over HTTP.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from bench.toolkit import report as rp

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
SHAPES = (
    ("decode x1", 1, 128, 0),
    ("decode x8", 8, 128, 0),
    ("decode x32", 32, 128, 0),
    ("prefill 512", 1, 0, 512),
)
"""(name, sequences, context tokens each, prefill tokens of the one chunk)."""


def _linears(model):
    from engine.cpu_linear import PackedLinear
    from engine.quant.linear import QuantLinear

    return [
        m for m in model.modules() if isinstance(m, (QuantLinear, PackedLinear, torch.nn.Linear))
    ]


def products_ms(model, rows: int, sampled: int, reps: int) -> float:
    """Every linear layer once on ``rows`` rows (the LM head on ``sampled``), back to back."""
    lins = _linears(model)
    head = model.lm_head
    inputs = [torch.randn(sampled if m is head else rows, m.in_features) for m in lins]
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for m, x in zip(lins, inputs):
                m(x)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def attention_ms(runner, seqs: int, context: int, chunk: int, reps: int) -> float:
    """The attention kernel of every layer for the shape, on a cache of the runner's
    geometry (decodes: one query per sequence on ``context`` tokens; prefill: one chunk of
    ``chunk`` tokens)."""
    kernels = runner.attention.cpu_kernels
    if kernels is None:
        return float("nan")
    k_cache, v_cache = runner.kv_caches[0]
    _, bs, kvh, d = k_cache.shape
    heads = runner.model.config.num_attention_heads
    tokens = max(context + 1, chunk)
    blocks = -(-tokens // bs)
    tables = torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks) % len(k_cache)
    layers = len(runner.kv_caches)
    scale = d**-0.5
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for k, v in runner.kv_caches:
            if chunk:
                q = torch.randn(chunk, heads, d)
                out = torch.empty_like(q)
                qsl = torch.tensor([0, chunk], dtype=torch.int32)
                lens = torch.tensor([chunk], dtype=torch.int32)
                kernels.prefill_attention(q, k, v, tables, qsl, lens, 0, scale, out)
            else:
                q = torch.randn(seqs, heads, d)
                out = torch.empty_like(q)
                lens = torch.full((seqs,), context + 1, dtype=torch.int32)
                kernels.decode_attention(q, k, v, tables, lens, scale, out)
        times.append(time.perf_counter() - t0)
    assert layers == len(runner.kv_caches)
    return 1000 * statistics.median(times[1:])


def profile_shape(llm, name: str, seqs: int, context: int, chunk: int, steps: int) -> dict:
    from engine import SamplingParams

    engine = llm.llm_engine
    runner = engine.runner
    records = []
    saved = engine.on_step
    engine.on_step = records.append
    try:
        if chunk:
            rounds = []
            for r in range(steps + 1):
                prompt = [1000 + (r * 7919 + j * 13) % 30000 for j in range(chunk)]
                engine.add_request(
                    f"p{r}",
                    {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=1, temperature=0),
                )
                n = len(records)
                while engine.has_unfinished_requests():
                    engine.step()
                rounds.append(records[n:])
            steps_used = [rs[0] for rs in rounds[1:]]
        else:
            sp = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
            for i in range(seqs):
                prompt = [1000 + (i * 7919 + j * 13) % 30000 for j in range(context)]
                engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, sp)
            while engine.has_unfinished_requests():
                engine.step()
            steps_used = [r for r in records if r.num_decodes == seqs and r.num_prefill_tokens == 0]
            steps_used = steps_used[4 : 4 + steps]
    finally:
        engine.on_step = saved
    split = _split(steps_used)
    rows = chunk or seqs
    sampled = 1 if chunk else seqs
    split["products"] = products_ms(runner.model, rows, sampled, 5)
    split["attention"] = attention_ms(runner, seqs, context, chunk, 5)
    split["rest of forward"] = split["forward"] - split["products"] - split["attention"]
    split["steps"] = len(steps_used)
    return split


def _split(records) -> dict:
    """Mean ms per step: the step, and its phases (as ``bench.gpu_check``'s decode step)."""
    n = len(records)
    out = {"step": 1000 * sum(r.seconds for r in records) / n}
    out["schedule"] = 1000 * sum(r.schedule_s for r in records) / n
    for name in ("prepare", "forward", "sample"):
        out[name] = 1000 * sum(dict(r.phases).get(name, 0.0) for r in records) / n
    out["other"] = out["step"] - sum(out[k] for k in ("schedule", "prepare", "forward", "sample"))
    return out


def run(args) -> dict:
    from engine import LLM

    result: dict = {"engines": {}}
    for q in ("auto", "none"):
        llm = LLM(quantization=q, num_kv_blocks=1024, max_num_seqs=64)
        w = llm.llm_engine.runner.weights
        shapes = {
            name: profile_shape(llm, name, seqs, ctx, chunk, args.steps)
            for name, seqs, ctx, chunk in SHAPES
        }
        result["engines"][q] = {"weights": w.describe(), "shapes": shapes}
        print(f"[step_profile] {q}: {w.describe()}", flush=True)
        del llm
        gc.collect()
    return result


COLUMNS = (
    "step",
    "schedule",
    "prepare",
    "products",
    "attention",
    "rest of forward",
    "sample",
    "other",
)


def table(result: dict) -> list[str]:
    lines = [
        "| weights | shape | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---:|" * len(COLUMNS),
    ]
    for e in result["engines"].values():
        for name, s in e["shapes"].items():
            cells = [f"{s[c]:.2f}" for c in COLUMNS]
            lines.append(f"| {e['weights']} | {name} | " + " | ".join(cells) + " |")
    return lines + ["", "Milliseconds per step (means); products and attention timed alone."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24, help="steps averaged per shape")
    p.add_argument("--out", default=str(RESULTS / "step_profile.json"))
    args = p.parse_args(argv)
    print("[step_profile] expected duration ~3 min", flush=True)
    t0 = time.monotonic()
    result = run(args)
    result["wall_s"] = time.monotonic() - t0
    result = {"run": rp.run_record(), **result}
    rp.write_json(result, args.out)
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
