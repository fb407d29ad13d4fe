"""The offline throughput benchmark's workers: one function per system, each run in its own
subprocess by ``bench/engine_throughput.py`` (``--worker NAME``), which owns the workload,
the spawning, the aggregation and the report.

Each worker takes the workload (``prompts``, ``output_lens``) and its system's config and
returns a JSON-able result: wall time of generation only (model load, KV allocation and a
tiny warm-up excluded), tokens per request, and the CPU load seen during the timed section
(the measuring is in ``bench/offline_measure.py``). This module holds iterserve's workers and
the dispatch (:data:`WORKERS`, :func:`worker_main`); transformers' are in
``bench/offline_hf.py``. :func:`worker_sweep` is the decode sweep: it reads each step's
``engine.StepRecord`` from the engine's ``on_step`` hook (duration, ``schedule_s`` and the
runner's ``phases``).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from cpu_load import cpu_snapshot, foreign_cores
from offline_hf import worker_hf_generate, worker_hf_generate_batch
from offline_measure import Timed, make_result, peak_rss_mib, rss_mib, set_threads


def _make_llm(cfg: dict):
    """iterserve's LLM on the embedded model, sized by the benchmark's config."""
    from engine import LLM

    return LLM(
        model=None,
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        block_size=cfg["block_size"],
        num_kv_blocks=cfg["num_kv_blocks"],
        dtype="float32",
        cpu_weight_prepack=cfg["cpu_weight_prepack"],
    )


def worker_iterserve(wl: dict, cfg: dict) -> dict:
    from engine import SamplingParams

    t0 = time.perf_counter()
    llm = _make_llm(cfg)
    setup = time.perf_counter() - t0
    rss_loaded = rss_mib()
    engine = llm.llm_engine
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:32]} for p in wl["prompts"][:2]], warm, use_tqdm=False)
    preempted_before = engine.scheduler.num_preemptions

    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in wl["output_lens"]
    ]
    with Timed() as tm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = tm.wall
    preemptions = engine.scheduler.num_preemptions - preempted_before
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    e2e = [o.metrics.finish_time - o.metrics.arrival_time for o in outs]
    return make_result(
        wl,
        wall,
        [list(o.outputs[0].token_ids) for o in outs],
        setup_s=setup,
        rss_after_load_mib=rss_loaded,
        preemptions=preemptions,
        foreign_cores=tm.foreign,
        own_cores=tm.own,
        ttft_s_p50=statistics.median(ttft),
        e2e_s_p50=statistics.median(e2e),
        model_dir=str(engine.model_dir),
    )


def _gemm_flops(n: int, reps: int) -> tuple[float, list[float]]:
    import torch

    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    for _ in range(2):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times), times


PHASES = ("schedule", "prepare", "forward", "sample")
"""The step's parts the sweep reports: ``StepRecord.schedule_s`` and the runner's phases."""


def _num_params(model) -> int:
    """Parameters the forward multiplies by (tied embeddings once)."""
    from engine.cpu_linear import PackedLinear

    # Prepacked layers hold their weights as buffers; a tied LM head's plain weight is the
    # embedding's, already a parameter.
    return sum(p.numel() for p in model.parameters()) + sum(
        m.packed_weight.numel()
        for m in model.modules()
        if isinstance(m, PackedLinear) and not m.tied
    )


def _decode_steps(
    engine, steps: list, prompts: list[list[int]], skip: int, measure: int
) -> tuple[list[dict], float | None]:
    """Run ``prompts`` until ``skip + measure`` steps have had every sequence decoding.

    ``steps`` is the list ``engine.on_step`` appends each :class:`engine.StepRecord` to.
    Returns the measured steps (seconds of the whole step and of each of :data:`PHASES`)
    and the cores other processes kept busy over them.
    """
    from engine import SamplingParams

    n = len(prompts)
    params = SamplingParams(max_tokens=skip + measure + 4, temperature=0, ignore_eos=True)
    ids = [f"sweep{n}-{i}" for i in range(n)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    prefill_steps = 0
    records: list[dict] = []
    meas_start = None  # (cpu snapshot, time) before the first measured step
    while len(records) < skip + measure:
        steps.clear()
        snap = cpu_snapshot()
        t = time.perf_counter()
        engine.step()
        if not steps:
            raise RuntimeError(f"sweep at {n} seqs: a step ran nothing")
        rec = steps[-1]
        if not rec.num_decodes == len(rec.seqs) == n:  # a prefill is still in this step
            prefill_steps += 1
            if records or prefill_steps > 100:
                raise RuntimeError(f"sweep at {n} seqs: not all sequences decoding")
            continue
        if len(records) == skip:
            meas_start = (snap, t)
        phases = dict(rec.phases)
        records.append(
            {
                "step": rec.seconds,
                "schedule": rec.schedule_s,
                **{k: phases.get(k, 0.0) for k in PHASES[1:]},
            }
        )
    foreign = foreign_cores(meas_start[0], cpu_snapshot(), time.perf_counter() - meas_start[1])
    engine.abort(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return records[skip:], foreign


def _sweep_point(n: int, rec: list[dict], roofline: float, foreign: float | None) -> dict:
    total = sum(r["step"] for r in rec)
    phase = {k: sum(r[k] for r in rec) / len(rec) for k in PHASES}
    step_mean = total / len(rec)
    other = step_mean - sum(phase.values())
    tok_s = n * len(rec) / total
    return {
        "num_seqs": n,
        "steps_measured": len(rec),
        "tok_s": tok_s,
        "pct_roofline": 100 * tok_s / roofline,
        "step_ms_mean": 1000 * step_mean,
        "step_ms_median": 1000 * statistics.median(r["step"] for r in rec),
        "breakdown_ms": {**{k: 1000 * v for k, v in phase.items()}, "other": 1000 * other},
        "sched_prep_pct": 100 * (phase["schedule"] + phase["prepare"]) / step_mean,
        "outside_forward_pct": 100 * (step_mean - phase["forward"]) / step_mean,
        "foreign_cores": foreign,
    }


def worker_sweep(wl: dict, cfg: dict) -> dict:
    """Decode tokens/s at several batch sizes, with a per-phase breakdown of each step
    from the engine's ``on_step`` records."""
    import torch

    gemm_flops, gemm_times = _gemm_flops(cfg["gemm_size"], cfg["gemm_reps"])
    llm = _make_llm(cfg)
    engine = llm.llm_engine
    n_params = _num_params(engine.runner.model)
    roofline = gemm_flops / (2 * n_params)
    steps: list = []
    engine.on_step = steps.append

    rng = random.Random(cfg["seed"] + 1)
    points = []
    for n in cfg["batch_sizes"]:
        prompts = [
            [rng.randrange(*cfg["token_id_range"]) for _ in range(cfg["prompt_len"])]
            for _ in range(n)
        ]
        rec, foreign = _decode_steps(engine, steps, prompts, cfg["warm_steps"], cfg["steps"])
        points.append(_sweep_point(n, rec, roofline, foreign))
    return {
        "gemm": {
            "n": cfg["gemm_size"],
            "reps": cfg["gemm_reps"],
            "gflop_s": gemm_flops / 1e9,
            "times_s": gemm_times,
        },
        "num_params": n_params,
        "flop_per_token": 2 * n_params,
        "roofline_tok_s": roofline,
        "torch_threads": torch.get_num_threads(),
        "prompt_len": cfg["prompt_len"],
        "points": points,
    }


WORKERS = {
    "iterserve": worker_iterserve,
    "iterserve_noprepack": worker_iterserve,
    "hf_generate": worker_hf_generate,
    "hf_generate_batch": worker_hf_generate_batch,
    "sweep": worker_sweep,
}


def worker_main(name: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    set_threads(spec["config"])
    try:
        res = WORKERS[name](spec["workload"], spec["config"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which records it
        import traceback

        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    res["peak_rss_mib"] = peak_rss_mib()
    import torch

    res["torch_threads"] = torch.get_num_threads()
    Path(result_path).write_text(json.dumps(res))
