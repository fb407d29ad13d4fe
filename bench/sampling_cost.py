"""What random sampling adds to a decode step, iterserve against vLLM's CPU build.

Real traffic samples: the OpenAI API's default temperature is 1, and chat clients often
set ``top_p`` or ``top_k``. Every other benchmark here is greedy. This one decodes
``--streams`` sequences (32-token prompts of random ids, ``ignore_eos``) with greedy,
temperature 1, temperature 0.8 with top-p 0.9, and temperature 0.8 with top-k 50, and
reports each setting's cost per step, (wall(T tokens) - wall(1 token)) / (T - 1) as in
``bench/offline_peer.py``, and what it adds over greedy. Each engine runs in its own venv,
one after the other (about 6 minutes)::

    .venv/bin/python bench/sampling_cost.py

Prints a table and writes ``bench/results/sampling_cost.json``. With ``--engine`` it
measures one engine in the running interpreter and writes ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
}


def measure(engine: str, model: str, streams: int, tokens: int, repeats: int) -> dict:
    """ms per decode step for each of :data:`SETTINGS` (median of ``repeats``)."""
    sys.path[:0] = [str(REPO / "bench"), str(REPO)]
    from offline_peer import Engine, median_of

    eng = Engine(engine, model)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(streams)]
    out = {}
    for name, params in SETTINGS.items():
        long = median_of(
            functools.partial(eng.run, [(p, tokens) for p in prompts], **params), repeats
        )
        short = median_of(functools.partial(eng.run, [(p, 1) for p in prompts], **params), repeats)
        out[name] = 1000 * (long - short) / (tokens - 1)
    return out


def drive(args: argparse.Namespace) -> dict:
    """Both engines, each in its venv; the report."""
    sys.path[:0] = [str(REPO / "bench"), str(REPO)]
    import peer_servers as ps

    model = args.model or ps.model_dir()
    print(f"expected duration: about {6 * args.repeats / 2:.0f} min", flush=True)
    res = {}
    for name, py in (
        ("vllm", Path(args.vllm_venv) / "bin/python"),
        ("iterserve", REPO / ".venv/bin/python"),
    ):
        path = RESULTS / f".sampling_{name}.json"
        cmd = [
            str(py),
            __file__,
            "--engine",
            name,
            "--model",
            model,
            "--out",
            str(path),
            "--streams",
            str(args.streams),
            "--tokens",
            str(args.tokens),
            "--repeats",
            str(args.repeats),
        ]
        print(f"[sampling] {name}", flush=True)
        subprocess.run(
            cmd,
            check=True,
            env=ps.engine_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        res[name] = json.loads(path.read_text())
        path.unlink()
    return {"streams": args.streams, "tokens": args.tokens, "model": model, "ms_per_step": res}


def table(rep: dict) -> str:
    ms = rep["ms_per_step"]
    lines = [
        f"decode, {rep['streams']} streams: ms per step (added over greedy)",
        f"{'setting':<14} {'vLLM':>16} {'iterserve':>16}",
    ]
    for name in SETTINGS:
        cells = [
            f"{ms[e][name]:.1f} ({ms[e][name] - ms[e]['greedy']:+.1f})"
            for e in ("vllm", "iterserve")
        ]
        lines.append(f"{name:<14} {cells[0]:>16} {cells[1]:>16}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--engine",
        choices=["iterserve", "vllm"],
        default=None,
        help="measure one engine here (the driver runs both)",
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=49)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(REPO / ".venv-vllm")))
    p.add_argument("--out", type=Path, default=RESULTS / "sampling_cost.json")
    args = p.parse_args(argv)
    if args.engine:
        result = measure(args.engine, args.model, args.streams, args.tokens, args.repeats)
        args.out.write_text(json.dumps(result, indent=1))
        return 0
    rep = drive(args)
    args.out.write_text(json.dumps(rep, indent=1) + "\n")
    print(table(rep))
    return 0


if __name__ == "__main__":  # vLLM's engine core starts a process by spawn
    sys.exit(main())
