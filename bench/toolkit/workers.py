"""The offline throughput workers and the subprocess each runs in: iterserve's
``LLM.generate`` (:func:`worker_iterserve`), transformers' ``model.generate`` on static
batches and continuous batching (:func:`worker_hf_generate`, :func:`worker_hf_generate_batch`),
and iterserve's decode sweep (:func:`worker_sweep`), for :mod:`bench.engine_throughput`, which
holds their workload, configs and report.

Each worker takes the workload (``{"prompts": [[token id, ...], ...], "output_lens": [...]}``)
and its config, loads its model, makes one tiny warm-up call of the API it measures, times
the rest with :class:`Timed` and returns :func:`make_result`: throughput over the wall time,
after checking that every request got exactly its output length. The sweep instead steps
iterserve's engine by hand at each batch size and returns tokens/s against the GEMM roofline,
with each step split by its :class:`engine.StepRecord`.

:func:`spawn` runs one worker in its own subprocess, so that peak RSS is the worker's own: it
writes ``{"workload": ..., "config": ...}`` to a temporary spec file, runs
``python -m bench.toolkit.workers NAME --spec SPEC --result RESULT`` from the repository root
(:func:`worker_main`: ``config["threads"]`` torch threads when set) and returns the result
file, with ``peak_rss_mib`` and ``torch_threads`` added. When the worker fails, ``error``
stands in for the measurements: with its ``traceback`` when the worker raised, and the tail
of its stderr (``stderr_tail``) unless it timed out.

torch, transformers and the engine are imported where used.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.toolkit import REPO, cli
from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores
from bench.toolkit.offline import greedy_requests
from bench.toolkit.steps import PHASES


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


# iterserve: LLM.generate on all requests at once.
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
        # The embedded GGUF de-quantized, as transformers loads it: the systems compared
        # multiply by the same fp32 weights (the packed weights are bench.peers_packed's).
        quantization=cfg.get("quantization", "none"),
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

    prompts, params = greedy_requests(SamplingParams, zip(wl["prompts"], wl["output_lens"]))
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


# iterserve's decode sweep: tokens/s at several batch sizes, each step split.
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


def _num_params(model) -> int:
    """Parameters the forward multiplies by (tied embeddings once)."""
    from engine.cpu.linear import PackedLinear
    from engine.quant.linear import QuantLinear

    # Prepacked and packed-quantized layers hold their weights as buffers; a tied LM
    # head's plain weight is the embedding's, already a parameter. A packed embedding is
    # only looked up (its LM head, tied or not, is a QuantLinear).
    n = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, PackedLinear) and not m.tied:
            n += m.packed_weight.numel()
        elif isinstance(m, QuantLinear):
            n += m.in_features * m.out_features
    return n


def _decode_steps(
    engine, steps: list, prompts: list[list[int]], skip: int, measure: int
) -> tuple[list[dict], float | None]:
    """Run ``prompts`` until ``skip + measure`` steps have had every sequence decoding.

    ``steps`` is the list a step listener of ``engine`` appends each
    :class:`engine.StepRecord` to.
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
    from the engine's step records."""
    import torch

    gemm_flops, gemm_times = _gemm_flops(cfg["gemm_size"], cfg["gemm_reps"])
    llm = _make_llm(cfg)
    engine = llm.llm_engine
    n_params = _num_params(engine.runner.model)
    roofline = gemm_flops / (2 * n_params)
    steps: list = []
    engine.add_step_listener(steps.append)

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


# The subprocess: the dispatch, the worker's side and the parent's.
WORKERS = {
    "iterserve": worker_iterserve,
    "iterserve_noprepack": worker_iterserve,
    "hf_generate": worker_hf_generate,
    "hf_generate_batch": worker_hf_generate_batch,
    "sweep": worker_sweep,
}


def worker_main(name: str, spec_path: str, result_path: str) -> None:
    """The subprocess's side: run worker ``name`` on the spec file's workload and config, and
    write its result (or its error) with the process's peak RSS and torch threads."""
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


def spawn(name: str, workload: dict, config: dict, timeout: float) -> dict:
    """Worker ``name``'s result on ``workload`` and ``config``, run in its own subprocess
    (killed after ``timeout`` seconds); ``{"error": ...}`` when it fails."""
    with tempfile.TemporaryDirectory(prefix="iterserve-bench-") as tmp:
        spec, result = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec.write_text(json.dumps({"workload": workload, "config": config}))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [
            sys.executable,
            "-m",
            "bench.toolkit.workers",
            name,
            "--spec",
            str(spec),
            "--result",
            str(result),
        ]
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if result.is_file():
            res = json.loads(result.read_text())
        else:
            res = {"error": f"worker exited with {proc.returncode} and no result"}
        if "error" in res:
            res["stderr_tail"] = proc.stderr[-3000:]
        return res


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.toolkit.workers", __doc__)
    p.add_argument("name", choices=sorted(WORKERS), help="the worker to run")
    p.add_argument("--spec", required=True, help="JSON: the workload and the config")
    p.add_argument("--result", required=True, help="where the worker writes its JSON result")
    args = p.parse_args(argv)
    worker_main(args.name, args.spec, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
