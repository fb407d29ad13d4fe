"""Which attention backend a runner uses: PyTorch SDPA, the CPU kernels, or flash-attn.

The choice is :attr:`engine.EngineConfig.attention_backend`. ``auto`` decides by device and
availability:

* CUDA: flash-attn where it imports and ``block_size`` is a multiple of
  :data:`FLASH_BLOCK_MULTIPLE`, else SDPA (logged);
* CPU in fp32: the kernels of :mod:`engine.cpu_kernels` where they build, else SDPA;
* anything else: SDPA.

A named backend is used or refused with :class:`ValueError`, never swapped for another. The
flash-attn function itself is injectable (``flash_attn_varlen_func``): the tests run the
flash-attn path on CPU with a reference implementation of the kernel's contract
(``tests/flash_reference.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from engine.cpu_kernels import CpuKernels
from engine.cpu_kernels import load as load_cpu_kernels

logger = logging.getLogger(__name__)

FLASH_BLOCK_MULTIPLE = 256
"""flash-attn reads a paged cache only in blocks of a multiple of 256 tokens (its
``mha_varlen_fwd`` refuses others: "Paged KV cache block size must be divisible by 256")."""

BackendName = Literal["sdpa", "cpu_kernels", "flash_attn"]
BackendChoice = Literal["auto", "sdpa", "cpu_kernels", "flash_attn"]


class FlashAttnVarlenFunc(Protocol):
    """``flash_attn.flash_attn_varlen_func`` as the engine calls it, on a paged cache.

    Args:
        q: ``[total_q, H, D]``, the step's queries, sequence after sequence.
        k, v: ``[num_blocks, block_size, KVH, D]``, the paged cache (``H % KVH == 0``).
        cu_seqlens_q: ``[B + 1]`` int32, offsets of each sequence's queries in ``q``.
        cu_seqlens_k: ``[B + 1]`` int32, running sums of each sequence's key count (its
            whole context, this step's tokens included).
        max_seqlen_q, max_seqlen_k: the longest query run and context of the batch.
        softmax_scale: multiplies ``q @ k.T`` before the softmax.
        causal: a query attends to keys up to its own position, the mask aligned to the
            bottom right (the last query of a sequence sees its whole context).
        block_table: ``[B, max_blocks]`` int32, each sequence's cache blocks in order.

    Returns:
        ``[total_q, H, D]``.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        softmax_scale: float | None,
        causal: bool,
        block_table: torch.Tensor,
    ) -> torch.Tensor: ...


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
