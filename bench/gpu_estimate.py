"""The GPU check's estimate on paper: where an eager decode step of this engine should stand
on an H100, from the figures of a :mod:`bench.gpu_check` run (the dry run's, on the CPU).

An eager PyTorch forward issues its kernels one at a time from Python, while the GPU's work
for a small model's decode step is little more than reading the weights once: the step takes
about the larger of its host time and that floor. :func:`paper_estimate` bounds the host time
from the run's own measurements and sets it against the floor; ``python -m bench.gpu_check``
records the estimate under ``"estimate"`` and prints :func:`table`. The reasoning and the
figures of the committed dry run: ``docs/gpu.md``.
"""

from __future__ import annotations

from typing import Any

from bench.toolkit import report as rp

HBM_BYTES_PER_S = 3.35e12
"""H100 SXM memory bandwidth, 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet; the PCIe
card has 2 TB/s, the NVL 3.9 TB/s)."""
HBM_SOURCE = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s"


def paper_estimate(result: dict[str, Any], context_tokens: int) -> dict[str, Any] | None:
    """Where an eager decode step should stand on an H100, from a run's own figures.

    The GPU's floor for one decode step, ``gpu_floor_ms``: the bf16 weights read once plus
    the streams' K and V at ``context_tokens`` each (the real run's context), over
    :data:`HBM_BYTES_PER_S`. The host's time, between two bounds, per stream count (eager
    PyTorch issues the forward's kernels one by one, so a step takes about the larger of
    host and GPU time):

    * ``host_low_ms``: the step's host work outside the forward (schedule, prepare, other:
      :func:`bench.toolkit.steps.split_ms`; the sample is left out, it runs on the GPU)
      plus the forward's kernel ops times the cost of one tiny op (``dispatch``:
      :func:`bench.gpu_check.dispatch_cost`, no Python module code, no CUDA launch);
    * ``host_high_ms``: the same plus the sample, with the forward's host time read by the
      profiler (its Python between ops plus its kernel ops times their median self time,
      profiler overhead included).

    The forward's host time does not depend on the batch on a GPU, so both take it from the
    fewest streams. ``share_of_floor_*`` = ``gpu_floor_ms / max(host, gpu_floor_ms)``: the
    part of the bandwidth-bound throughput an eager step reaches, which is also its ratio to
    an engine running at that bound. ``graphed_share_of_floor``: the same with the forward
    replayed as one CUDA graph (its host time gone, the rest of the step as now), and
    ``vs_graphed_*``: the eager step's throughput against that graphed step's, the ratio to
    a peer that graphs its decode forward and spends as long as this engine outside it
    (vLLM's way). None when the decode or profile step did not run.
    """
    steps = {s["name"]: s for s in result["steps"]}
    decode, prof = steps.get("decode"), steps.get("profile")
    if not decode or not prof or "ok" != decode["status"] or "ok" != prof["status"]:
        return None
    f = prof["figures"]
    weights = 2 * f["model_params"]
    fewest = min(f["points"], key=lambda q: q["streams"])
    ops = fewest["kernel_ops_per_forward"]
    forward_low = ops * f["dispatch"]["launch_us"] / 1000
    forward_high = fewest["forward_python_ms"] + ops * fewest["small_op_self_cpu_us_median"] / 1000
    rows = []
    for p in decode["figures"]["points"]:
        n, split = p["streams"], p["split_ms"]
        outside = split["schedule"] + split["prepare"] + split["other"]
        low, high = outside + forward_low, outside + split["sample"] + forward_high
        kv = n * context_tokens * f["kv_bytes_per_token_bf16"]
        floor = 1000 * (weights + kv) / HBM_BYTES_PER_S
        rows.append(
            {
                "streams": n,
                "outside_forward_ms": outside,
                "host_low_ms": low,
                "host_high_ms": high,
                "gpu_floor_ms": floor,
                "share_of_floor_high": floor / max(low, floor),
                "share_of_floor_low": floor / max(high, floor),
                "graphed_share_of_floor": floor / max(outside, floor),
                "vs_graphed_low": max(outside, floor) / max(high, floor),
                "vs_graphed_high": max(outside, floor) / max(low, floor),
                "floor_tokens_per_s": n / floor * 1000,
            }
        )
    return {
        "kernel_ops_per_forward": ops,
        "forward_host_low_ms": forward_low,
        "forward_host_high_ms": forward_high,
        "weights_bytes_bf16": weights,
        "context_tokens": context_tokens,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "hbm_source": HBM_SOURCE,
        "points": rows,
    }


def table(estimate: dict[str, Any]) -> str:
    """The estimate as a markdown table, one row per stream count."""
    header = ["streams", "host ms (est.)", "GPU floor ms", "floor tok/s"]
    header += ["eager share of floor", "graphed share of floor", "eager vs graphed"]
    rows = [
        [
            str(p["streams"]),
            f"{p['host_low_ms']:.1f}-{p['host_high_ms']:.1f}",
            f"{p['gpu_floor_ms']:.3f}",
            f"{p['floor_tokens_per_s']:.0f}",
            f"{100 * p['share_of_floor_low']:.1f}-{100 * p['share_of_floor_high']:.1f}%",
            f"{100 * p['graphed_share_of_floor']:.1f}%",
            f"{100 * p['vs_graphed_low']:.0f}-{100 * p['vs_graphed_high']:.0f}%",
        ]
        for p in estimate["points"]
    ]
    return rp.table(header, rows)
