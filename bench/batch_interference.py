"""Does a batch sent ``--via-service`` take the interactive class's SLO headroom?

One ``iterserve serve`` (the peers benchmark's settings: the interactive class declared
with TTFT <= 2 s and TPOT <= 0.25 s, an API key for it) takes an open-loop interactive
load: a window of the Azure conversation trace, lengths divided by 8, at ``--rate``
req/s. The same replay runs in alternating phases, alone and while
``python -m deploy.batch --via-service`` sends the batch file of
``bench/batch_throughput.py`` at the batch class. Each phase replays other prompt text,
so no phase is served from another's KV.

Figures: the interactive class's SLO attainment in each phase (the target: with the batch
within 2 percentage points of without), and the batch's output tokens/s while it ran (its
records' tokens over the seconds from its start to its stop).

    .venv/bin/python bench/batch_interference.py     # about 9 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import peer_servers as ps
import serve_bench as sb
from batch_throughput import write_batch
from prometheus_client.parser import text_string_to_metric_families
from targets import http_client
from workload import Lengths

REPO = ps.REPO
SLO = (2.0, 0.25)


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


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, default=1.0, help="interactive req/s")
    p.add_argument("--num-requests", type=int, default=90)
    p.add_argument("--window-start", type=int, default=0)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--batch-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8, help="the batch's --max-concurrency")
    p.add_argument("--out", default=str(REPO / "bench/results/batch_interference.json"))
    args = p.parse_args()
    per_phase = args.num_requests / args.rate + 20
    print(
        f"[interference] expected duration: about {(60 + 2 * args.pairs * per_phase) / 60:.0f} min",
        flush=True,
    )
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
    print("| phase | interactive within SLOs | batch output tok/s |\n|---|---:|---:|")
    for a, b, t in zip(alone, shared, tok_s):
        print(f"| alone | {a:.1%} | |\n| with batch | {b:.1%} | {t} |")
    print(f"mean difference: {result['difference_pp']} percentage points (target <= 2)")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
