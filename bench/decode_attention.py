"""Decode step time with mixed context lengths: SDPA decode groups vs one padded call.

Run from the repository root::

    .venv/bin/python bench/decode_attention.py     # about 4 minutes on 2 CPU cores

The SDPA backend pads every decode in a call to the call's longest context, so one long
context makes every short decode pay for its length. The engine splits decodes into groups
of similar length (``engine.attention.decode_groups``, at most ``DECODE_SPLIT_SLOTS``
padded slots saved per extra call). This benchmark times ``LLMEngine.step`` on decode-only
steps of several mixes of context lengths, with the groups (``grouped``) and with the split
disabled (``one call``: ``DECODE_SPLIT_SLOTS`` set to infinity, i.e. one padded SDPA call as
before the groups existed), in the same process, alternating the two variants run by run.

Each (mix, variant, run): the mix's requests (prompts of random token ids from
``random.Random(0)``, greedy, ``ignore_eos``) are prefilled, two decode steps warm up, then
``--steps`` decode steps are timed; the median step is the run's figure. Reported: the
median over ``--runs`` runs per variant and the median of the per-run ratios
(one call / grouped). Writes ``bench/results/decode_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from cpu_load import cpu_snapshot, foreign_cores

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIXES = {  # name -> [(number of decodes, prompt tokens)]
    "24 x 100": [(24, 100)],
    "23 x 100 + 1 x 600": [(23, 100), (1, 600)],
    "12 x 50 + 12 x 400": [(12, 50), (12, 400)],
    "40 x 30 + 4 x 500": [(40, 30), (4, 500)],
}


def time_mix(engine, mix, steps: int, rng: random.Random, tag: str) -> tuple[float, int]:
    """(median seconds of ``steps`` decode-only steps of ``mix``, decode groups in the
    first timed step)."""
    from engine.attention import decode_groups
    from engine.request import SamplingParams

    ids = []
    for g, (n, plen) in enumerate(mix):
        for i in range(n):
            rid = f"{tag}-{g}-{i}"
            prompt = [rng.randrange(1000, 40000) for _ in range(plen)]
            engine.add_request(
                rid,
                {"prompt_token_ids": prompt},
                SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True),
            )
            ids.append(rid)
    sched = engine.scheduler
    while sched.waiting or any(r.num_pending_tokens > 1 for r in sched.running):
        engine.step()
    engine.step()
    engine.step()
    groups = len(decode_groups(sorted((r.num_tokens for r in sched.running), reverse=True)))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort(ids)
    return statistics.median(times), groups


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "decode_attention.json"
    )
    args = ap.parse_args()

    import torch

    from engine import LLM, attention

    llm = LLM(max_num_seqs=64, num_kv_blocks=2048, max_num_batched_tokens=4096)
    engine = llm.llm_engine
    split = attention.DECODE_SPLIT_SLOTS
    variants = {"grouped": split, "one call": math.inf}
    rng = random.Random(0)
    rows = []
    t0 = time.perf_counter()
    for name, mix in MIXES.items():
        got: dict[str, list[float]] = {v: [] for v in variants}
        groups = 0
        cpu0, w0 = cpu_snapshot(), time.perf_counter()
        for run in range(args.runs):
            order = list(variants) if run % 2 == 0 else list(reversed(variants))
            for v in order:
                attention.DECODE_SPLIT_SLOTS = variants[v]
                seconds, n = time_mix(engine, mix, args.steps, rng, f"{name}-{v}-{run}")
                got[v].append(seconds)
                if v == "grouped":
                    groups = n
        attention.DECODE_SPLIT_SLOTS = split
        other = foreign_cores(cpu0, cpu_snapshot(), time.perf_counter() - w0)
        rows.append(
            {
                "mix": name,
                "decodes": sum(n for n, _ in mix),
                "groups": groups,
                "grouped_ms": 1e3 * statistics.median(got["grouped"]),
                "one_call_ms": 1e3 * statistics.median(got["one call"]),
                "ratio": statistics.median(a / b for a, b in zip(got["one call"], got["grouped"])),
                "runs_ms": {v: [1e3 * x for x in xs] for v, xs in got.items()},
                "other_load_cores": other,
            }
        )
    print(
        "| decode mix (decodes x prompt tokens) | groups | grouped ms/step | one call "
        "ms/step | one call / grouped | other load |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['mix']} | {r['groups']} | {r['grouped_ms']:.0f} | {r['one_call_ms']:.0f} | "
            f"{r['ratio']:.2f}x | {r['other_load_cores']:.2f} |"
        )
    report = {
        "benchmark": "decode_attention",
        "created_utc": datetime.now(UTC).isoformat(),
        "command": " ".join(sys.argv),
        "runs": args.runs,
        "steps": args.steps,
        "decode_split_slots": split,
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "method": __doc__,
        "rows": rows,
        "elapsed_s": time.perf_counter() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
