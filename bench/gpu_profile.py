"""The GPU check's profile analysis (:mod:`bench.gpu_check`, its ``profile`` step): from the
events ``torch.profiler`` recorded over engine steps, the aten ops per forward that launch a
CUDA kernel in an eager forward, the forward's Python time between ops, and on CUDA the GPU
kernel time, copies and launches per step. Pure event analysis: it takes the events and
``torch``, and starts nothing."""

from __future__ import annotations

import re
import statistics
from typing import Any

NO_KERNEL_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::transpose",
        "aten::t",
        "aten::permute",
        "aten::slice",
        "aten::select",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::expand",
        "aten::as_strided",
        "aten::alias",
        "aten::detach",
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::resolve_conj",
        "aten::resolve_neg",
        "aten::split",
        "aten::split_with_sizes",
        "aten::chunk",
        "aten::narrow",
        "aten::unbind",
        "aten::contiguous",
        "aten::lift_fresh",
        "aten::result_type",
        "aten::to",
        "aten::flatten",
        "aten::detach_",
        "aten::resize_",
        "aten::is_nonzero",
        "aten::item",
        "aten::type_as",
        "aten::size",
        "aten::stride",
        "aten::numel",
        "aten::dim",
    }
)
"""aten ops that change only a tensor's metadata or allocate (``aten::to`` with no copy
below it is a no-op): no CUDA kernel of their own."""

NO_KERNEL_SUBTREES = frozenset({"aten::scalar_tensor", "aten::lift_fresh"})
"""aten ops that build a host scalar or wrap a host tensor, whatever runs below them."""

ONE_KERNEL_ON_CUDA = frozenset({"aten::_fused_rms_norm"})
"""aten ops that the CPU runs as several ops and CUDA as one fused kernel (PyTorch's
``_fused_rms_norm`` has a CUDA kernel; on the CPU it decomposes into pow, mean, add, rsqrt,
mul and casts). Counted as one op in ``kernel_ops_per_forward``; the real run's
``launches_per_forward`` is the reading."""

LAUNCH_EVENTS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
    }
)
"""The CUDA runtime and driver calls the profiler records for one kernel launch or copy."""

COMPUTE_OP = re.compile(r"mm|attention|_fused_rms_norm")
"""Ops whose CPU time is mostly arithmetic (matrix products, attention, fused norms); the
others' self time on small decode tensors is mostly dispatch."""

FORWARD_RANGE = "gpu_check.forward"
"""The profiler range put around the model's forward (forward pre- and post-hooks)."""


def kernel_ops(event, out: list, fused: bool = True) -> bool:
    """Append to ``out`` the aten ops under ``event`` (itself included) that launch a CUDA
    kernel in an eager forward: those none of whose descendants does, views and
    allocations (:data:`NO_KERNEL_OPS`) left out, and (``fused``) each op of
    :data:`ONE_KERNEL_ON_CUDA` as one. True when any was found."""
    if event.name in NO_KERNEL_SUBTREES:
        return False
    if fused and event.name in ONE_KERNEL_ON_CUDA:
        out.append(event)
        return True
    found = False
    for child in event.cpu_children:
        found |= kernel_ops(child, out, fused)
    if not found and event.name.startswith("aten::") and event.name not in NO_KERNEL_OPS:
        out.append(event)
        return True
    return found


def profile_figures(events, steps: int, cuda: bool, torch) -> dict[str, Any]:
    """Per-forward and per-step figures of ``events`` (``prof.events()`` of a profile over
    ``steps`` engine steps, the forward in :data:`FORWARD_RANGE` ranges): op counts, host
    milliseconds and microseconds, and with ``cuda`` GPU kernel and copy milliseconds and
    launches. The keys are the ``profile`` step's result keys."""
    cpu_type = torch.autograd.DeviceType.CPU
    # With CUDA on, a range is also recorded on the GPU's timeline: the host's one counts.
    forwards = [e for e in events if e.name == FORWARD_RANGE and e.device_type == cpu_type]
    launching: list = []
    unfused: list = []
    launches_in_forward = syncs = 0
    python_us = 0.0
    for fwd in forwards:
        kernel_ops(fwd, launching)
        kernel_ops(fwd, unfused, fused=False)
        # Time in the range but in no op: the model's Python code between ops.
        python_us += fwd.cpu_time_total - sum(c.cpu_time_total for c in fwd.cpu_children)
        stack = list(fwd.cpu_children)
        while stack:
            e = stack.pop()
            launches_in_forward += e.name in LAUNCH_EVENTS
            syncs += e.name == "aten::_local_scalar_dense"
            stack.extend(e.cpu_children)
    nf = max(len(forwards), 1)
    forward_cpu_us = sum(f.cpu_time_total for f in forwards) / nf
    small = [e.self_cpu_time_total for e in launching if not COMPUTE_OP.search(e.name)]
    by_name: dict[str, int] = {}
    for e in launching:
        by_name[e.name] = by_name.get(e.name, 0) + 1
    out: dict[str, Any] = {
        "steps": steps,
        "forwards": len(forwards),
        "host_syncs_per_forward": syncs / nf,
        "kernel_ops_per_forward": len(launching) / nf,
        "cpu_kernel_ops_per_forward": len(unfused) / nf,
        "forward_cpu_ms": forward_cpu_us / 1000,
        "forward_python_ms": python_us / nf / 1000,
        "forward_cpu_us_per_kernel_op": forward_cpu_us / max(len(launching) / nf, 1),
        "small_op_self_cpu_us_median": statistics.median(small) if small else None,
        "kernel_ops_by_name_per_forward": {
            k: v / nf for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])
        },
    }
    if cuda:
        device_type = torch.autograd.DeviceType.CUDA
        on_gpu = [
            e
            for e in events
            if e.device_type == device_type
            and e.name != FORWARD_RANGE
            and not getattr(e, "is_user_annotation", False)
        ]
        copies = [e for e in on_gpu if e.name.lower().startswith(("memcpy", "memset"))]
        kernels = [e for e in on_gpu if e not in copies]
        out.update(
            {
                "kernel_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels)
                / 1000
                / steps,
                "copy_ms_per_step": sum(e.time_range.elapsed_us() for e in copies) / 1000 / steps,
                "kernels_per_step": len(kernels) / steps,
                "launches_per_step": sum(e.name in LAUNCH_EVENTS for e in events) / steps,
                "launches_per_forward": launches_in_forward / nf,
            }
        )
    return out
