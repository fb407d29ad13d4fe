"""Products on packed weights (``engine/quant/kernels.c``, dispatched by
``engine/quant/qdispatch.c``), compiled on first use and called through ctypes.

The library is built as :mod:`engine.cpu.kernels`' is (``cc``, into
``$ITERSERVE_CACHE/kernels``, once per source, compiler and CPU), but never with
``-march=native``: ``kernels.c`` is compiled once per instruction set (x86-64-v4 for
AVX-512, x86-64-v3 for AVX2/FMA/F16C, and the target's baseline) and the dispatcher picks
the best one the running CPU has (``__builtin_cpu_supports``). Where the compiler lacks the
x86-64 levels (or on another architecture) only the baseline is built.

``ITERSERVE_QUANT_LEVEL`` (0, 3 or 4) forces a lower level, so that every variant can be
tested on one machine; ``ITERSERVE_CPU_KERNELS=0`` turns these kernels off with the others.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess
from pathlib import Path

import torch

from engine.cpu.kernels import OPENMP_FLAG, CompileUnit, compile_library, open_library
from engine.quant.formats import PackedTensor

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
KERNELS_C, DISPATCH_C, DECODE_C = HERE / "kernels.c", HERE / "qdispatch.c", HERE / "decode.c"
FLAGS = ("-O3", "-ffast-math", "-fPIC", "-shared")
X86_LEVELS = (("v4", "-march=x86-64-v4"), ("v3", "-march=x86-64-v3"))
LEVEL_ENV = "ITERSERVE_QUANT_LEVEL"
LEVEL_NAMES = {0: "baseline", 3: "x86-64-v3 (AVX2)", 4: "x86-64-v4 (AVX-512)"}

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "q_matmul": (_C, [_C, _P, _I, _I, _I, _P, _I, _I, _P, _I, _P, _I]),
    "q_expand": (_C, [_C, _P, _I, _I, _P, _I, _P, _I, _I]),
    "q_set_level": (_C, [_C]),
    "q_level": (_C, []),
    "q_cpu_level": (_C, []),
    "q_decode_layers": (_C, [_P, _I, _P, _P, _P]),
}


class KernelError(RuntimeError):
    """A kernel refused its arguments (an unknown format) or ran out of memory."""


class QuantKernels:
    """The compiled products, on fp32 CPU tensors.

    Callers guarantee layouts (:class:`engine.quant.linear.QuantLinear` builds them); the
    kernels check the format only.
    """

    def __init__(self, lib: ctypes.CDLL, parallel: bool = True) -> None:
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib = lib
        self._matmul = lib.q_matmul
        self.decode_layers = lib.q_decode_layers
        """``q_decode_layers`` of ``engine/quant/decode.c`` (see
        :mod:`engine.quant.decode_stack`)."""
        self.parallel = parallel
        """Products share their rows among ``torch.get_num_threads()`` threads, else run on
        one."""

    @property
    def level(self) -> int:
        """The instruction-set level in use: 0 (baseline), 3 (AVX2) or 4 (AVX-512)."""
        return self._lib.q_level()

    def set_level(self, level: int) -> None:
        """Use the variant of ``level`` (at most the CPU's).

        Raises:
            ValueError: this CPU cannot run ``level``, or it was not built.
        """
        if self._lib.q_set_level(level) != level:
            raise ValueError(f"this CPU or build has no kernel level {level}")

    def matmul(
        self,
        w: PackedTensor,
        x: torch.Tensor,
        out: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        """``out = x @ W.T (+ bias)`` for ``x`` ``[m, k]`` (rows contiguous) into ``out``
        ``[m, w.rows]`` (rows contiguous, any row stride: a column slice of a wider output).

        Raises:
            KernelError: the kernel refused the format or had no memory.
        """
        rc = self._matmul(
            w.fmt.type_id,
            w.data.data_ptr(),
            w.data.shape[1],
            w.data.shape[0],
            w.k,
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            out.data_ptr(),
            out.stride(0),
            None if bias is None else bias.data_ptr(),
            torch.get_num_threads() if self.parallel else 1,
        )
        if rc:
            raise KernelError(f"q_matmul({w.fmt.name}) failed: {rc}")

    def matmul_call(self):
        """``(fn, threads)`` for callers that bind a weight once: ``fn(type_id, w_ptr,
        row_bytes, rows, k, x_ptr, x_stride, m, out_ptr, out_stride, bias_ptr, threads())``
        is :meth:`matmul` without its checks (a nonzero result is an error)."""
        fn = self._matmul
        if self.parallel:
            return _checked(fn), torch.get_num_threads
        return _checked(fn), _one

    def expand(self, w: PackedTensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape; all rows when None) of ``w`` de-quantized:
        ``[*ids.shape, k]`` fp32 (``[rows, k]`` when None). Equal bit for bit to ggml's
        de-quantization (gguf-py's ``gguf.quants.dequantize``).

        Raises:
            KernelError: the kernel refused the format.
        """
        flat = None if ids is None else ids.reshape(-1).to(torch.int64).contiguous()
        n = w.rows if flat is None else flat.numel()
        out = torch.empty((n, w.k), dtype=torch.float32)
        rc = self._lib.q_expand(
            w.fmt.type_id,
            w.data.data_ptr(),
            w.data.shape[1],
            w.k,
            None if flat is None else flat.data_ptr(),
            n,
            out.data_ptr(),
            w.k,
            torch.get_num_threads() if self.parallel else 1,
        )
        if rc:
            raise KernelError(f"q_expand({w.fmt.name}) failed: {rc}")
        return out if ids is None else out.view(*ids.shape, w.k)


def _one() -> int:
    return 1


def _checked(fn):
    def call(*args) -> None:
        if fn(*args):
            raise KernelError(f"q_matmul(type {args[0]}) failed")

    return call


def _units() -> list[CompileUnit]:
    units = [CompileUnit(KERNELS_C, ("-DVARIANT=generic",))]
    if platform.machine() in ("x86_64", "AMD64"):
        units += [CompileUnit(KERNELS_C, (march, f"-DVARIANT={v}")) for v, march in X86_LEVELS]
        return [*units, CompileUnit(DISPATCH_C), CompileUnit(DECODE_C)]
    return [*units, CompileUnit(DISPATCH_C, ("-DQ_GENERIC_ONLY",)), CompileUnit(DECODE_C)]


def build(out_dir: Path) -> tuple[Path, bool]:
    """Compile the library into ``out_dir``: ``(library, with OpenMP)``.

    Raises:
        OSError, subprocess.CalledProcessError: no compiler, or compilation failed.
    """
    units = _units()
    try:
        return compile_library(out_dir, "quant", units, (), (*FLAGS, OPENMP_FLAG)), True
    except subprocess.CalledProcessError as e:
        logger.warning("packed-weight kernels without OpenMP (one thread): %s", e.stderr)
    try:
        return compile_library(out_dir, "quant", units, (), FLAGS), False
    except subprocess.CalledProcessError as e:
        # A compiler without the x86-64 levels: the baseline alone.
        logger.warning("packed-weight kernels for the baseline only: %s", e.stderr)
        units = [CompileUnit(KERNELS_C, ("-DVARIANT=generic",))]
        units += [CompileUnit(DISPATCH_C, ("-DQ_GENERIC_ONLY",)), CompileUnit(DECODE_C)]
        return compile_library(out_dir, "quant", units, (), FLAGS), False


@functools.cache
def load() -> QuantKernels | None:
    """The kernels, or None where they are disabled or cannot be built (logged once).

    Raises:
        ValueError: ``ITERSERVE_QUANT_LEVEL`` names a level this CPU cannot run.
    """
    opened = open_library(build, "packed-weight kernels unavailable")
    if opened is None:
        return None
    lib, openmp = opened
    kernels = QuantKernels(lib, parallel=openmp)
    if LEVEL_ENV in os.environ:
        kernels.set_level(int(os.environ[LEVEL_ENV]))
    return kernels
