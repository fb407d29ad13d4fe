"""Step time of AsyncLLMEngine with the model built on its stepping thread or on another.

Run from the repository root::

    .venv/bin/python bench/engine_thread.py     # about 4 minutes on 2 CPU cores

torch's OpenMP backend (libgomp) keeps a team of worker threads for every thread that has
run a parallel op, and shortens its spin-wait once the process holds more of them than
there are CPUs, so every op then wakes its workers through the kernel.
``AsyncLLMEngine.from_config`` therefore builds the engine on the worker thread that steps
it (``worker``). ``caller`` is the layout before that change: the engine built on the
event-loop thread (``AsyncLLMEngine(LLMEngine.from_config(config))``), stepped on the worker.

Each (mix, variant, run) is a fresh process, because a thread's OpenMP team lives as long
as the thread. The mix's requests (prompts of random token ids from ``random.Random(0)``,
greedy, ``ignore_eos``) stream through ``AsyncLLMEngine.generate`` at once; every step's
duration comes from ``LLMEngine.on_step``. Reported per variant: the median over ``--runs``
runs of each run's median step, separately for steps with prefill tokens and decode-only steps (the
first two decode-only steps are left out as warm-up), and the median of the per-run ratios
(caller / worker; runs alternate variants). Writes ``bench/results/engine_thread.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXES = {"4 x 50": (4, 50), "24 x 50": (24, 50)}
"""Requests x prompt tokens; each generates 60 tokens."""
OUTPUT_TOKENS = 60
CONFIG = dict(max_num_batched_tokens=128, max_num_seqs=64, num_kv_blocks=1024)
"""The scheduling benchmark's chunked-prefill engine settings."""


def child(variant: str, n: int, prompt_len: int) -> dict[str, float]:
    """One run in this process; returns median step seconds (prefill steps, decode steps)."""
    sys.path.insert(0, ROOT)
    from engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(n)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    prefill, decode = [], []

    async def run() -> None:
        config = EngineConfig(**CONFIG)
        if variant == "worker":
            aeng = AsyncLLMEngine.from_config(config)
        else:
            aeng = AsyncLLMEngine(LLMEngine.from_config(config))

        def on_step(rec) -> None:
            (prefill if rec.num_prefill_tokens else decode).append(rec.seconds)

        aeng.engine.on_step = on_step

        async def one(i: int) -> None:
            async for _ in aeng.generate(
                {"prompt_token_ids": prompts[i]}, params, request_id=f"r{i}"
            ):
                pass

        try:
            await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await aeng.shutdown()

    asyncio.run(run())
    return {"prefill_s": statistics.median(prefill), "decode_s": statistics.median(decode[2:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "engine_thread.json"))
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "N", "PROMPT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        v, n, p = args.child
        print(json.dumps(child(v, int(n), int(p))))
        return
    t0 = time.time()
    results = {}
    for mix, (n, p) in MIXES.items():
        runs: dict[str, list[dict[str, float]]] = {"worker": [], "caller": []}
        for _ in range(args.runs):
            for variant in runs:
                out = (
                    subprocess.run(
                        [sys.executable, __file__, "--child", variant, str(n), str(p)],
                        check=True,
                        capture_output=True,
                        text=True,
                        cwd=ROOT,
                    )
                    .stdout.strip()
                    .splitlines()[-1]
                )
                runs[variant].append(json.loads(out))
        row = {"runs": runs}
        for kind in ("prefill_s", "decode_s"):
            for variant, rs in runs.items():
                row[f"{variant}_{kind}"] = statistics.median(r[kind] for r in rs)
            row[f"ratio_{kind}"] = statistics.median(
                c[kind] / w[kind] for c, w in zip(runs["caller"], runs["worker"])
            )
        results[mix] = row
    print("| mix (requests x prompt tokens) | step | worker ms | caller ms | caller / worker |")
    print("|---|---|---:|---:|---:|")
    for mix, row in results.items():
        for kind, name in (("prefill_s", "with prefill"), ("decode_s", "decode-only")):
            print(
                f"| {mix} | {name} | {1000 * row[f'worker_{kind}']:.0f} "
                f"| {1000 * row[f'caller_{kind}']:.0f} | {row[f'ratio_{kind}']:.2f}x |"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "results": results,
                "config": CONFIG,
                "output_tokens": OUTPUT_TOKENS,
                "runs": args.runs,
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "wall_s": time.time() - t0,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
