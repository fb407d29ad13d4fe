"""bench.gpu_check: its dry run walks every step on the CPU, and its profile arithmetic."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from bench import gpu_check, gpu_int4, gpu_profile


def _event(name, children=(), cpu_us=0.0, self_us=0.0, device="cpu", elapsed_us=0.0):
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name,
        cpu_children=list(children),
        cpu_time_total=cpu_us,
        self_cpu_time_total=self_us,
        device_type=kind,
        time_range=SimpleNamespace(elapsed_us=lambda: elapsed_us),
    )


def test_profile_counts_the_ops_that_launch_kernels_and_the_gpu_time():
    # One forward: a linear (mm under views and a resolve_conj leaf), a no-op `to`, an RMS
    # norm fused on CUDA (four CPU ops below it), a launch, a host scalar; then two kernels
    # and a copy on the GPU.
    launch = _event("cudaLaunchKernel")
    mm = _event("aten::mm", [_event("aten::resolve_conj")], cpu_us=30, self_us=29)
    linear = _event("aten::linear", [_event("aten::t"), mm], cpu_us=40)
    norm = _event(
        "aten::_fused_rms_norm",
        [_event(n, self_us=2) for n in ("aten::pow", "aten::mean", "aten::add", "aten::rsqrt")],
        cpu_us=10,
    )
    add = _event("aten::add", [launch], cpu_us=5, self_us=5)
    scalar = _event("aten::scalar_tensor", [_event("aten::fill_")], cpu_us=1)
    to = _event("aten::to", cpu_us=1)
    forward = _event(gpu_check.FORWARD_RANGE, [linear, to, norm, add, scalar], cpu_us=100)
    gpu = [
        _event("ampere_sgemm", device="cuda", elapsed_us=50),
        _event("rms_norm_kernel", device="cuda", elapsed_us=10),
        _event("Memcpy HtoD", device="cuda", elapsed_us=4),
        # The forward's range on the GPU's timeline: neither a forward nor a kernel.
        _event(gpu_check.FORWARD_RANGE, device="cuda", elapsed_us=70),
    ]
    events = [forward, launch, _event("cudaMemcpyAsync"), *gpu]

    cpu = gpu_profile.profile_figures(events, steps=2, cuda=False, torch=torch)
    assert cpu["kernel_ops_per_forward"] == 3  # mm, the fused norm, add
    assert cpu["cpu_kernel_ops_per_forward"] == 6  # mm, pow, mean, add, rsqrt, add
    assert cpu["forward_python_ms"] == pytest.approx((100 - 57) / 1000)
    assert cpu["kernel_ops_by_name_per_forward"] == {
        "aten::mm": 1,
        "aten::_fused_rms_norm": 1,
        "aten::add": 1,
    }
    assert cpu["small_op_self_cpu_us_median"] == 5  # the add; mm and the norm are compute
    assert "kernel_ms_per_step" not in cpu

    cuda = gpu_profile.profile_figures(events, steps=2, cuda=True, torch=torch)
    assert cuda["kernel_ms_per_step"] == pytest.approx(0.030)
    assert cuda["copy_ms_per_step"] == pytest.approx(0.002)
    assert cuda["kernels_per_step"] == 1
    assert cuda["launches_per_step"] == 1  # the kernel launch and the copy, over 2 steps
    assert cuda["launches_per_forward"] == 1


@pytest.mark.slow
def test_dry_run_walks_every_step_on_the_cpu(tmp_path):
    tiny = dataclasses.replace(
        gpu_check.DRY_PLAN,
        decode_streams=(2,),
        decode_prompt_len=4,
        decode_warm_steps=1,
        decode_steps=1,
        profile_steps=1,
        prefill_lengths=(8,),
        greedy_prompts=(2,),
        greedy_max_tokens=2,
        reference_prompts=(2,),
        reference_max_tokens=2,
        dispatch_reps=10,
        run_pytest=False,  # a subprocess importing torch; the committed dry run ran it
    )
    result = gpu_check.run_check(tiny)
    steps = {s["name"]: s for s in result["steps"]}
    assert tuple(steps) == gpu_check.STEPS
    failed = {n: s["error"] for n, s in steps.items() if s["status"] == "failed"}
    assert not failed
    assert steps["tests_gpu"]["status"] == "skipped"
    assert steps["memory"]["status"] == "skipped" and "CUDA" in steps["memory"]["reason"]
    assert all(s["status"] == "ok" for n, s in steps.items() if n not in ("tests_gpu", "memory"))
    decode = steps["decode"]["figures"]["points"]
    assert [p["streams"] for p in decode] == [2] and decode[0]["tokens_per_s"] > 0
    profile = steps["profile"]["figures"]["points"][0]
    layers = 30  # SmolLM2-135M: q/k/v fused, o, gate/up fused, down per layer, and the LM head
    assert profile["kernel_ops_by_name_per_forward"]["aten::mm"] == 4 * layers + 1
    assert steps["prefill"]["figures"]["points"][0]["tokens"] == 8
    for name in ("greedy", "reference_flash"):
        assert steps[name]["figures"]["exact"] == 1, steps[name]
    assert steps["reference_flash"]["figures"]["reference_calls"] > 0
    out = tmp_path / "r.json"
    gpu_check.rp.write_json({"run": gpu_check.rp.run_record(), **result}, out)
    table = gpu_check.table(json.loads(out.read_text()))
    assert all(f"| {n} |" in table for n in gpu_check.STEPS)


def test_the_committed_dry_run_names_every_step_and_none_failed():
    result = json.loads((gpu_check.RESULTS / "gpu_check_dry_run.json").read_text())
    steps = {s["name"]: s for s in result["steps"]}
    assert tuple(steps) == gpu_check.STEPS
    for name, s in steps.items():
        assert s["status"] in ("ok", "skipped"), (name, s["error"])
        assert s["status"] == "ok" or s["reason"], name
    assert result["plan"]["device"] == "cpu"
    assert "needs CUDA" in steps["tests_gpu"]["reason"]  # pytest ran, and skipped


def test_int4_packing_is_what_the_cuda_kernel_de_quantizes():
    """``_weight_int4pack_mm`` de-quantizes ``(q - 8) scale + zero``, two values a byte, the
    even column in the high nibble: the packing's own de-quantization must be that."""
    import torch

    w = torch.randn(6, 96)
    packed, sz, deq = gpu_int4.int4_pack(w)
    assert packed.shape == (6, 48) and packed.dtype == torch.uint8 and sz.shape == (3, 6, 2)
    q = torch.stack([packed >> 4, packed & 15], dim=-1).view(6, 96).float()
    scale, zero = sz[..., 0].T, sz[..., 1].T
    kernel = ((q.view(6, 3, 32) - 8) * scale[..., None] + zero[..., None]).view(6, 96)
    torch.testing.assert_close(kernel, deq, rtol=0, atol=1e-6)
    step = (w.view(6, 3, 32).amax(2) - w.view(6, 3, 32).amin(2)) / 15
    assert ((deq - w).view(6, 3, 32).abs() <= step[..., None] / 2 + 1e-6).all()


def test_the_int4_step_is_skipped_on_the_cpu():
    check = gpu_check.Check(gpu_check.DRY_PLAN, None, "none", False)
    outcome = gpu_check.run_step("int4", check)
    assert outcome.status == "skipped" and "CUDA" in outcome.reason
