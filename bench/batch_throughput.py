"""Offline batch throughput: ``iterserve batch run`` against vLLM's ``run_batch``.

One batch file of chat requests (vLLM's ``run_batch`` serves ``/v1/chat/completions``, not
``/v1/completions``): prompt and output lengths from a window of the Azure code trace
(``bench/workload.py``), scaled down so that a run takes a few minutes here; prompts are
real text of exactly that many tokens (``bench/prompts.py``); ``ignore_eos`` and
``max_tokens`` fix every output's length. Both systems read the same file with the same
weights (the embedded model's converted directory), fp32, on every core, one run at a
time, alternating systems so that both see the host's drift alike.

Figures per run: output tokens / s over the batch's processing time (each system's own
progress bar, from its first request to its last; model loading excluded) and over the
command's whole wall time. The table gives each system's median of ``--repeats`` runs.

    .venv/bin/python bench/batch_throughput.py            # 2 x 3 runs, 11-30 minutes
    .venv/bin/python bench/batch_throughput.py --repeats 1 --requests 300   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_servers import MODEL_NAME, REPO, engine_env, machine_info, model_dir
from prompts import prompt_maker
from workload import Lengths, read_trace

from deploy.sim.trace import trace_path

TRACE = trace_path("code")
REFERENCE_S = {"iterserve": 110.0, "vllm": 160.0}
"""Seconds one whole command on the default file takes on this 2-core host, for the
expected duration printed first: 86-91 s and 125-131 s on 2026-12-05 (Intel), plus a
margin; the AMD host of 2026-12-03 took about 250 and 320 s."""
SYSTEM = "Continue the text."
"""A short system message: without one the model's template adds its own 20-token one,
which at these scaled lengths would be most of every prompt."""
_BAR = re.compile(r"(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<")


def write_batch(path: Path, rows: int, start: int, lengths: Lengths) -> dict:
    """The batch file; returns its totals."""
    maker = prompt_maker(model_dir(), 0)
    prompt_total = output_total = 0
    with open(path, "w") as f:
        for r in read_trace(TRACE, start, rows)[:rows]:
            n_in, n_out = lengths.prompt(r.context_tokens), lengths.output(r.generated_tokens)
            text, got = maker.make(r.row, n_in)
            prompt_total += got
            output_total += n_out
            body = {
                "model": MODEL_NAME,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": text},
                ],
                "max_tokens": n_out,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            f.write(
                json.dumps(
                    {
                        "custom_id": f"row-{r.row}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": body,
                    }
                )
                + "\n"
            )
    return {"requests": rows, "prompt_tokens": prompt_total, "output_tokens": output_total}


def command(system: str, src: Path, dest: Path) -> tuple[list[str], dict]:
    if system == "vllm":
        py = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm")) / "bin/python"
        return (
            [
                str(py),
                "-m",
                "vllm.entrypoints.openai.run_batch",
                "-i",
                str(src),
                "-o",
                str(dest),
                "--model",
                model_dir(),
                "--served-model-name",
                MODEL_NAME,
                "--dtype",
                "float32",
                "--max-model-len",
                "2048",
            ],
            engine_env(),
        )
    return (
        [
            str(REPO / ".venv/bin/iterserve"),
            "batch",
            "run",
            "--input",
            str(src),
            "--output",
            str(dest),
        ],
        dict(os.environ),
    )


def bar_seconds(log: str, total: int) -> float:
    """Elapsed seconds of the last tqdm frame that shows ``total`` done."""
    best = None
    for m in _BAR.finditer(log):
        if int(m.group(1)) == total == int(m.group(2)):
            best = int(m.group(3) or 0) * 3600 + int(m.group(4)) * 60 + int(m.group(5))
    if best is None:
        raise RuntimeError("no finished progress bar in the log:\n" + log[-2000:])
    return float(max(best, 1))


def output_tokens(dest: Path, expected: int) -> int:
    """Completion tokens over the output file's records; every record must be a 200."""
    tokens = n = 0
    for line in dest.read_text().splitlines():
        rec = json.loads(line)
        body = rec["response"]["body"]
        if rec["response"]["status_code"] != 200 or rec.get("error"):
            raise RuntimeError(f"a request failed: {line[:500]}")
        tokens += body["usage"]["completion_tokens"]
        n += 1
    if n != expected:
        raise RuntimeError(f"{dest} holds {n} records, not {expected}")
    return tokens


def one_run(system: str, src: Path, workdir: Path, k: int, totals: dict) -> dict:
    dest = workdir / f"{system}-{k}.jsonl"
    cmd, env = command(system, src, dest)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    (workdir / f"{system}-{k}.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} exited {proc.returncode}:\n{log[-3000:]}")
    tokens = output_tokens(dest, totals["requests"])
    busy = bar_seconds(log, totals["requests"])
    row = {
        "system": system,
        "run": k,
        "output_tokens": tokens,
        "busy_s": busy,
        "wall_s": round(wall, 1),
        "busy_tok_s": round(tokens / busy, 1),
        "wall_tok_s": round(tokens / wall, 1),
    }
    print(
        f"[batch] {system} run {k}: {tokens} tokens, {busy:.0f} s busy "
        f"({row['busy_tok_s']} tok/s), {wall:.0f} s wall ({row['wall_tok_s']} tok/s)",
        flush=True,
    )
    return row


def summarise(runs: list[dict], systems: list[str]) -> dict:
    out = {}
    for s in systems:
        mine = [r for r in runs if r["system"] == s]
        out[s] = {
            "busy_tok_s": statistics.median(r["busy_tok_s"] for r in mine),
            "wall_tok_s": statistics.median(r["wall_tok_s"] for r in mine),
        }
    if "vllm" in out:
        for key in ("busy_tok_s", "wall_tok_s"):
            out["iterserve"][key.replace("tok_s", "ratio")] = round(
                out["iterserve"][key] / out["vllm"][key], 2
            )
    return out


def table(summary: dict, totals: dict) -> str:
    lines = [
        f"Batch of {totals['requests']} chat requests ({totals['prompt_tokens']} prompt "
        f"and {totals['output_tokens']} output tokens), median of the runs",
        "",
        "| system | output tok/s (processing) | output tok/s (whole command) |",
        "|---|---:|---:|",
    ]
    for s, v in summary.items():
        ratio = (
            (f" ({v['busy_ratio']:.2f}x)", f" ({v['wall_ratio']:.2f}x)")
            if "busy_ratio" in v
            else ("", "")
        )
        lines.append(f"| {s} | {v['busy_tok_s']:.1f}{ratio[0]} | {v['wall_tok_s']:.1f}{ratio[1]} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--start", type=int, default=0, help="the trace window's first row")
    p.add_argument("--prompt-divisor", type=float, default=128.0)
    p.add_argument("--output-divisor", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", default=str(REPO / "bench/results/batch_throughput.json"))
    args = p.parse_args()
    systems = ["iterserve"] if args.skip_vllm else ["vllm", "iterserve"]
    scale = args.requests / 2000
    expected = args.repeats * sum(REFERENCE_S[s] * scale for s in systems)
    print(
        f"[batch] expected duration: about {expected / 60:.0f} min "
        f"({args.repeats} runs of {', '.join(systems)})",
        flush=True,
    )
    lengths = Lengths(
        prompt_divisor=args.prompt_divisor,
        output_divisor=args.output_divisor,
        min_output=1,
        max_prompt=1024,
        max_output=256,
    )
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        workdir = Path(tmp)
        src = workdir / "batch.jsonl"
        totals = write_batch(src, args.requests, args.start, lengths)
        runs = [one_run(s, src, workdir, k, totals) for k in range(args.repeats) for s in systems]
    summary = summarise(runs, systems)
    print(table(summary, totals))
    result = {
        "totals": totals,
        "lengths": lengths.describe(),
        "trace": str(TRACE.name),
        "window_start": args.start,
        "summary": summary,
        "runs": runs,
        "machine": machine_info(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"[batch] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
