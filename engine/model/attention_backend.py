"""Which attention backend a runner uses: PyTorch SDPA, the CPU kernels, or flash-attn.

The choice is :attr:`engine.EngineConfig.attention_backend`. ``auto`` decides by device and
availability:

* CUDA: flash-attn where it imports and ``block_size`` is a multiple of
  :data:`FLASH_BLOCK_MULTIPLE`, else SDPA (logged);
* CPU in fp32: the kernels of :mod:`engine.cpu.kernels` where they build, else SDPA;
* anything else: SDPA.

A named backend is used or refused with :class:`ValueError`, never swapped for another. The
flash-attn function itself is injectable (``flash_attn_varlen_func``): the tests run the
flash-attn path on CPU with a reference implementation of the kernel's contract
(``tests/flash_reference.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from engine.config import FLASH_BLOCK_MULTIPLE, BackendChoice
from engine.cpu.kernels import CpuKernels
from engine.cpu.kernels import load as load_cpu_kernels
from engine.layers.attention import FlashAttnVarlenFunc

logger = logging.getLogger(__name__)

BackendName = Literal["sdpa", "cpu_kernels", "flash_attn"]


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The backend a runner attends with, and what it needs.

    ``flash_attn_varlen_func`` is set for ``flash_attn`` only, ``cpu_kernels`` for
    ``cpu_kernels`` only.
    """

    name: BackendName
    flash_attn_varlen_func: FlashAttnVarlenFunc | None = None
    cpu_kernels: CpuKernels | None = None


def import_flash_attn() -> FlashAttnVarlenFunc | None:
    """flash-attn's ``flash_attn_varlen_func`` where CUDA is present and it imports, else
    None."""
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def select_attention_backend(
    choice: BackendChoice,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    flash_attn_varlen_func: FlashAttnVarlenFunc | None = None,
) -> AttentionBackend:
    """Resolve ``choice`` for a runner on ``device`` in ``dtype`` with ``block_size``-token
    KV blocks.

    ``flash_attn_varlen_func`` replaces flash-attn's own function (``choice`` ``auto`` or
    ``flash_attn``); it is how a test runs the flash-attn path without CUDA.

    Raises:
        ValueError: the named backend cannot run here (flash-attn missing or ``block_size``
            not a multiple of :data:`FLASH_BLOCK_MULTIPLE`; the CPU kernels off, unbuilt,
            or asked for on CUDA or outside fp32), or a function was given for another
            backend.
    """
    if flash_attn_varlen_func is not None and choice not in ("auto", "flash_attn"):
        raise ValueError(f"flash_attn_varlen_func given with attention_backend {choice!r}")
    if choice == "auto":
        return _auto(device, dtype, block_size, flash_attn_varlen_func)
    if choice == "sdpa":
        return AttentionBackend("sdpa")
    if choice == "cpu_kernels":
        kernels = load_cpu_kernels() if device.type == "cpu" and dtype == torch.float32 else None
        if kernels is None:
            raise ValueError(
                "attention_backend 'cpu_kernels' runs fp32 on the CPU with a C compiler "
                f"(device {device.type}, dtype {dtype}; ITERSERVE_CPU_KERNELS=0 turns them off)"
            )
        return AttentionBackend("cpu_kernels", cpu_kernels=kernels)
    if choice == "flash_attn":
        func = flash_attn_varlen_func or import_flash_attn()
        if func is None:
            raise ValueError(
                "attention_backend 'flash_attn' needs CUDA and the flash-attn package "
                "(pip install 'iterserve[gpu]')"
            )
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(
                f"attention_backend 'flash_attn' needs block_size a multiple of "
                f"{FLASH_BLOCK_MULTIPLE}, not {block_size}"
            )
        return AttentionBackend("flash_attn", flash_attn_varlen_func=func)
    raise ValueError(f"unknown attention_backend {choice!r}")


def _auto(
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    injected: FlashAttnVarlenFunc | None,
) -> AttentionBackend:
    if injected is not None:
        return select_attention_backend("flash_attn", device, dtype, block_size, injected)
    if device.type == "cuda":
        func = import_flash_attn()
        if func is not None and block_size % FLASH_BLOCK_MULTIPLE == 0:
            return AttentionBackend("flash_attn", flash_attn_varlen_func=func)
        logger.warning(
            "flash-attn path off (needs flash-attn and block_size %% %d == 0); using SDPA",
            FLASH_BLOCK_MULTIPLE,
        )
        return AttentionBackend("sdpa")
    if device.type == "cpu" and dtype == torch.float32 and (kernels := load_cpu_kernels()):
        return AttentionBackend("cpu_kernels", cpu_kernels=kernels)
    return AttentionBackend("sdpa")
