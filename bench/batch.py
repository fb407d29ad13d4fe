"""Batch inference: throughput against vLLM's ``run_batch``, and interference with live traffic.

Two measurements, each its own subcommand and result file, run from the repository root
(each prints its expected duration first)::

    python -m bench.batch throughput      # 2 x 3 runs; writes bench/results/batch_throughput.json
    python -m bench.batch throughput --repeats 1 --requests 300     # a quick look
    python -m bench.batch interference    # 2 pairs; writes bench/results/batch_interference.json

``throughput``: one batch file of chat requests (vLLM's ``run_batch`` serves
``/v1/chat/completions``, not ``/v1/completions``): prompt and output lengths from a window of
the Azure code trace (:mod:`bench.toolkit.workload`), scaled down so that a run takes a few
minutes here; prompts are real text of exactly that many tokens
(:mod:`bench.toolkit.prompts`); ``ignore_eos`` and ``max_tokens`` fix every output's length.
``iterserve batch run`` and vLLM's ``run_batch`` read the same file with the same weights (the
embedded model's converted directory), fp32, on every core, one run at a time, alternating
systems so that both see the host's drift alike. Figures per run: output tokens / s over the
batch's processing time (each system's own progress bar, from its first request to its last;
model loading excluded) and over the command's whole wall time. The table gives each system's
median of ``--repeats`` runs.

``interference``: does a batch sent ``--via-service`` take the interactive class's SLO
headroom? One ``iterserve serve`` (the peers benchmark's settings: the interactive class
declared with TTFT <= 2 s and TPOT <= 0.25 s, an API key for it) takes an open-loop
interactive load: a window of the Azure conversation trace, lengths divided by 8, at
``--rate`` req/s. The same replay runs in alternating phases, alone and while
``python -m deploy.batch --via-service`` sends the ``throughput`` batch file at the batch
class. Each phase replays other prompt text, so no phase is served from another's KV.
Figures: the interactive class's SLO attainment in each phase (the target: with the batch
within 2 percentage points of without), and the batch's output tokens/s while it ran (its
records' tokens over the seconds from its start to its stop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit import serve_bench as sb
from bench.toolkit import servers as ps
from bench.toolkit.prompts import prompt_maker
from bench.toolkit.servers import MODEL_NAME, engine_env, machine_info, model_dir
from bench.toolkit.targets import http_client
from bench.toolkit.workload import Lengths, read_trace
from deploy.sim.trace import trace_path

TRACE = trace_path("code")
REFERENCE_S = {"iterserve": 110.0, "vllm": 160.0}
"""Seconds one whole command on the default file takes on a 2-core host, with a margin: the
expected duration printed first (a slower host takes up to about twice as long)."""
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


def main_throughput(args: argparse.Namespace) -> int:
    systems = ["iterserve"] if args.skip_vllm else ["vllm", "iterserve"]
    scale = args.requests / 2000
    expected = args.repeats * sum(REFERENCE_S[s] * scale for s in systems)
    cli.expected("batch", expected, f"{args.repeats} runs of {', '.join(systems)}")
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
    result = {
        "totals": totals,
        "lengths": lengths.describe(),
        "trace": str(TRACE.name),
        "window_start": args.start,
        "summary": summary,
        "runs": runs,
        "machine": machine_info(),
    }
    rp.write_report(args.out, result, table(summary, totals), md_file=False)
    return 0


# interference

SLO = (2.0, 0.25)
"""The interference phases' interactive SLOs (TTFT, TPOT seconds): the peers benchmark's."""


def start_batch(src: Path, dest: Path, url: str, concurrency: int) -> subprocess.Popen:
    cmd = [
        str(REPO / ".venv/bin/python"),
        "-m",
        "deploy.batch",
        "--input",
        str(src),
        "--output",
        str(dest),
        "--via-service",
        url,
        "--max-concurrency",
        str(concurrency),
    ]
    # The server has API keys (the interactive class needs one): the batch sends the same
    # key, and asks for the batch class in its header.
    env = {**os.environ, "OPENAI_API_KEY": ps.MIX_API_KEY}
    # SIGINT stops it (phase()); a shell's background job would otherwise pass it ignored.
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def batch_tokens(dest: Path) -> tuple[int, int]:
    """(records, output tokens) in a batch output file so far.

    Raises:
        RuntimeError: a record is an error (the comparison would be meaningless).
    """
    recs = [json.loads(t) for t in dest.read_text().splitlines()] if dest.exists() else []
    if bad := [r for r in recs if r["error"] is not None]:
        raise RuntimeError(f"{len(bad)} batch requests failed, e.g. {bad[0]}")
    return len(recs), sum(r["response"]["body"]["usage"]["completion_tokens"] for r in recs)


async def rejections(client, base_url: str) -> dict[str, float]:
    """The interactive class's admission rejections so far, by reason (``/metrics``)."""
    text = (await client.get(f"{base_url}/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "iterserve:admission_rejections_total"
                and labels.get("traffic_class") == "interactive"
            ):
                out[labels["reason"]] = sample.value
    return out


async def phase(cfg: sb.BenchConfig, client, k: int, batch: dict | None) -> dict:
    """One replay of the interactive window; with ``batch``, while a batch runs."""
    proc, t0 = None, time.monotonic()
    refused_before = await rejections(client, cfg.base_url)
    if batch is not None:
        dest = batch["dir"] / f"out-{k}.jsonl"
        proc = start_batch(batch["src"], dest, cfg.base_url, batch["concurrency"])
        await asyncio.sleep(batch["lead_s"])  # the batch's queue fills first
    workload = sb.build_workload(cfg, cfg.rates[0], replay=k)
    result = await sb.run_rate(cfg, workload, cfg.rates[0], client)
    refused_after = await rejections(client, cfg.base_url)
    out = {
        "with_batch": batch is not None,
        "summary": result["summary"],
        "refused_by_reason": {
            r: n - refused_before.get(r, 0)
            for r, n in refused_after.items()
            if n > refused_before.get(r, 0)
        },
    }
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        records, tokens = batch_tokens(dest)
        ran = time.monotonic() - t0
        out["batch"] = {
            "records": records,
            "output_tokens": tokens,
            "seconds": round(ran, 1),
            "output_tok_s": round(tokens / ran, 1),
        }
    s = result["summary"]
    extra = f", batch {out['batch']['output_tok_s']} tok/s" if "batch" in out else ""
    print(
        f"[interference] phase {k} ({'with' if batch else 'without'} batch): interactive "
        f"attainment {s['attainment']:.1%} (refused {s['refused']}: "
        f"{out['refused_by_reason']}){extra}",
        flush=True,
    )
    await asyncio.sleep(cfg.cooldown_s)
    return out


async def run(args: argparse.Namespace, server: ps.Server, batch: dict) -> list[dict]:
    cfg = sb.BenchConfig(
        base_url=server.url,
        model=server.model_name,
        tokenizer=server.model_dir,
        window_start=args.window_start,
        num_requests=args.num_requests,
        rates=[args.rate],
        length_scale=8.0,
        slo_ttft_s=SLO[0],
        slo_tpot_s=SLO[1],
        label="interactive",
        class_mix={"interactive": 1.0},
        warmup=2,
        cooldown_s=5.0,
        extra_headers={"Authorization": f"Bearer {ps.MIX_API_KEY}"},
    )
    phases = []
    async with http_client(cfg.timeout_s) as client:
        await sb._warmup(cfg, client)
        for k in range(2 * args.pairs):
            phases.append(await phase(cfg, client, k, batch if k % 2 else None))
    return phases


def main_interference(args: argparse.Namespace) -> int:
    per_phase = args.num_requests / args.rate + 20
    cli.expected("interference", 60 + 2 * args.pairs * per_phase)
    model_dir = ps.model_dir()
    with tempfile.TemporaryDirectory(prefix="interference-") as tmp:
        batch = {
            "dir": Path(tmp),
            "src": Path(tmp) / "batch.jsonl",
            "lead_s": 10.0,
            "concurrency": args.concurrency,
        }
        write_batch(
            batch["src"],
            args.batch_requests,
            0,
            Lengths(prompt_divisor=128, output_divisor=4, max_output=256),
        )
        with ps.Server(ps.SYSTEMS["iterserve"], model_dir, mix=True, slo=SLO) as server:
            phases = asyncio.run(run(args, server, batch))
    alone = [ph["summary"]["attainment"] for ph in phases if not ph["with_batch"]]
    shared = [ph["summary"]["attainment"] for ph in phases if ph["with_batch"]]
    tok_s = [ph["batch"]["output_tok_s"] for ph in phases if ph["with_batch"]]
    result = {
        "rate": args.rate,
        "slo": SLO,
        "attainment_alone": alone,
        "attainment_with_batch": shared,
        "batch_output_tok_s": tok_s,
        "difference_pp": round(100 * (sum(alone) / len(alone) - sum(shared) / len(shared)), 1),
        "phases": phases,
        "machine": ps.machine_info(),
    }
    rp.write_report(args.out, result, "\n".join(interference_table(result)), md_file=False)
    return 0


def interference_table(result: dict) -> list[str]:
    """Each pair of phases' interactive attainment and the batch's output tokens/s, and the
    mean difference against its target, as markdown lines."""
    lines = ["| phase | interactive within SLOs | batch output tok/s |", "|---|---:|---:|"]
    for a, b, t in zip(
        result["attainment_alone"], result["attainment_with_batch"], result["batch_output_tok_s"]
    ):
        lines += [f"| alone | {a:.1%} | |", f"| with batch | {b:.1%} | {t} |"]
    lines.append("")
    lines.append(f"mean difference: {result['difference_pp']} percentage points (target <= 2)")
    return lines


COMMANDS = {"throughput": main_throughput, "interference": main_interference}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser("bench.batch", __doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="{throughput,interference}")
    what = "iterserve batch run against vLLM's run_batch, on one batch file"
    t = sub.add_parser("throughput", help=what, description=what)
    t.add_argument("--requests", type=int, default=2000)
    t.add_argument("--start", type=int, default=0, help="the trace window's first row")
    t.add_argument("--prompt-divisor", type=float, default=128.0)
    t.add_argument("--output-divisor", type=float, default=4.0)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--skip-vllm", action="store_true")
    cli.add_out(t, str(RESULTS / "batch_throughput.json"), "the result file")
    what = "the interactive class's attainment beside a batch sent --via-service, and alone"
    i = sub.add_parser("interference", help=what, description=what)
    i.add_argument("--rate", type=float, default=1.0, help="interactive req/s")
    i.add_argument("--num-requests", type=int, default=90)
    cli.add_window_start(i, 0)
    i.add_argument("--pairs", type=int, default=2)
    i.add_argument("--batch-requests", type=int, default=2000)
    i.add_argument("--concurrency", type=int, default=8, help="the batch's --max-concurrency")
    cli.add_out(i, str(RESULTS / "batch_interference.json"), "the result file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
