"""What structured output costs a decode step: 32 sequences under a JSON schema vs plain.

Run from the repository root::

    .venv/bin/python bench/structured_cost.py     # about 1 minute on 2 CPU cores

Each run adds ``--seqs`` requests (16-token prompts of random token ids, greedy) to one
``LLMEngine`` and steps it; only steps where every sequence decodes count (``on_step``),
the first two of those left out. ``json`` requests carry a schema that cannot complete
within ``max_tokens`` (an array of at least 1000 integers), so every sequence decodes under
its grammar to the end. Reported: the median step time, and the median of the runner's
``sample`` phase (where the grammar's bitmask is filled and applied), per variant, in
alternating runs (``--runs`` each). Writes ``bench/results/structured_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from report import table

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}


def run(engine, variant: str, seqs: int, max_tokens: int, seed: int) -> dict[str, float]:
    """One batch of ``seqs`` requests to the end; median step and sample-phase seconds."""
    from engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, json_schema=SCHEMA if variant == "json" else None
    )
    steps = []
    engine.on_step = steps.append
    for i in range(seqs):
        engine.add_request(
            f"{variant}-{seed}-{i}",
            {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(16)]},
            params,
        )
    while engine.has_unfinished_requests():
        engine.step()
    engine.on_step = None
    full = [r for r in steps if r.num_decodes == len(r.seqs) == seqs][2:]
    return {
        "step_s": statistics.median(r.seconds for r in full),
        "sample_s": statistics.median(dict(r.phases)["sample"] for r in full),
        "steps": len(full),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "structured_cost.json"))
    args = ap.parse_args(argv)
    print(
        f"# structured output cost: {args.seqs} sequences, {2 * args.runs} runs; expected "
        "duration about 1 min",
        flush=True,
    )
    from engine import LLMEngine
    from engine.config import EngineConfig

    t0 = time.time()
    engine = LLMEngine.from_config(EngineConfig(max_num_seqs=args.seqs, num_kv_blocks=512))
    run(engine, "json", 4, 8, seed=99)  # warm-up: kernels, and the grammar's compilation
    results: dict[str, list[dict[str, float]]] = {"plain": [], "json": []}
    for k in range(args.runs):
        for variant in results:
            results[variant].append(run(engine, variant, args.seqs, args.max_tokens, seed=k))
    summary = {
        v: {key: statistics.median(r[key] for r in rs) for key in ("step_s", "sample_s")}
        for v, rs in results.items()
    }
    extra = summary["json"]["step_s"] - summary["plain"]["step_s"]
    rows = [
        [v, f"{1000 * s['step_s']:.1f}", f"{1000 * s['sample_s']:.2f}"] for v, s in summary.items()
    ]
    print(table(["variant", "step ms (median)", "sample phase ms (median)"], rows))
    print(
        f"structured output adds {1000 * extra:.1f} ms a step at {args.seqs} sequences "
        f"({100 * extra / summary['plain']['step_s']:.1f}%)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "seqs": args.seqs,
                "max_tokens": args.max_tokens,
                "schema": SCHEMA,
                "runs": results,
                "summary": summary,
                "extra_step_s": extra,
                "wall_s": time.time() - t0,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
