"""Fused fp32 CPU kernels (``engine/cpu/kernels.c``, prefill attention in
``engine/cpu/prefill.c``), compiled on first use and called through ctypes.

At decode row counts a transformer layer's non-GEMM work is many small PyTorch ops, each
paying a fixed dispatch cost of a few microseconds, more than the work of a small row; one
C loop per fused step pays it once, ctypes call included. vLLM's CPU build closes the same
gap with its own C++ ops and a compiled graph; this module does it with a few plain C
loops, built with the system C compiler (``cc``) into ``$ITERSERVE_CACHE/kernels``
(default ``~/.cache/iterserve/kernels``) once per source, compiler and CPU, in about a
second. Attention, decode and prefill, runs here too, on the paged cache in place and on
torch's OpenMP threads (see ``OPENMP_FLAG``).

Without a C compiler, or with ``ITERSERVE_CPU_KERNELS=0``, :func:`load` returns None and
the engine runs its PyTorch ops instead (:mod:`engine.layers.fused`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cache_dir import cache_dir

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("kernels.c", "prefill.c"))
HEADERS = (Path(__file__).with_name("vec.h"),)
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-shared")
"""``-ffast-math`` lets the compiler vectorize the sums (their order changes, as it does
between PyTorch's own kernels) and decode attention's ``expf`` (glibc's vector math, which
assumes finite inputs: its softmax starts from -FLT_MAX, and prefill attention masks with
-1e30, not -inf)."""
FAST_MATH_FLAGS = ("-ffast-math",)
"""Flags for compiling only, never for linking (:func:`compile_library`)."""
OPENMP_FLAG = "-fopenmp"
"""The attention kernels share their work among OpenMP threads. The library then needs
``libgomp.so.1``; loaded after torch, whose CPU wheels ship their own libgomp under that
name, the dynamic linker binds it to torch's copy, so the kernel runs on torch's thread
pool: its threads are already awake after the GEMM before it. A second runtime would keep
its own threads spinning beside torch's, competing with them for the cores."""
DISABLE_ENV = "ITERSERVE_CPU_KERNELS"

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": (None, [_P, _I, _P, _I, _P, _P, _I, _I, _F, _I]),
    "silu_mul": (None, [_P, _P, _I, _I, _I]),
    "rope": (None, [_P, _I, _I, _I, _I, _P, _P, _I]),
    "cache_write": (None, [_P, _I, _P, _I, _P, _I, _I, _P, _P, _I, _I]),
    "decode_attention": (
        ctypes.c_int,
        [_P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I, _I, _I],
    ),
    "prefill_attention": (
        ctypes.c_int,
        [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _I, _I, _I],
    ),
}
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The KV cache element types the attention kernels read and write (``vec.h``), by
dtype."""


class CpuKernels:
    """The compiled kernels, called on fp32 CPU tensors whose last dimension is contiguous.

    Callers guarantee dtypes and layouts (the decoder layers of
    :mod:`engine.cpu.kernel_layers` build every tensor they pass); the kernels do not check.
    """

    def __init__(self, lib: ctypes.CDLL, parallel: bool = True) -> None:
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self._lib = lib
        self.parallel = parallel
        """The attention kernels run on ``torch.get_num_threads()`` threads, else on one."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        delta: torch.Tensor | None = None,
        parallel: bool = False,
    ) -> torch.Tensor:
        """RMSNorm of ``x`` (``[T, h]``) times ``weight`` (``[h]``), as a new ``[T, h]``.

        With ``delta`` (``[T, h]``), ``x += delta`` first, in place: the residual add that
        precedes the norm in a pre-norm decoder layer. ``parallel``: rows shared among
        the attention kernels' threads."""
        rows, h = x.shape
        out = torch.empty((rows, h), dtype=x.dtype)
        self._lib.add_rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            h,
            eps,
            self._threads() if parallel else 1,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor, parallel: bool = False) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` (``[T, 2n]`` contiguous);
        returns ``[T, n]``. ``parallel``: rows shared among the attention kernels' threads
        (worth waking them for a prefill step's rows, not a decode step's)."""
        rows, n2 = gate_up.shape
        out = torch.empty((rows, n2 // 2), dtype=gate_up.dtype)
        self._lib.silu_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, n2 // 2, self._threads() if parallel else 1
        )
        return out

    def rope_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parallel: bool = False
    ) -> None:
        """Rotary embedding in place on ``x`` (``[T, heads, d]``, heads contiguous within a
        row); ``cos``, ``sin``: ``[T, d]`` contiguous, as transformers' rotary module makes
        them (attention scaling folded in). ``parallel``: rows shared among the attention
        kernels' threads."""
        rows, heads, d = x.shape
        self._lib.rope(
            x.data_ptr(),
            x.stride(0),
            rows,
            heads,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            self._threads() if parallel else 1,
        )

    def cache_write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        parallel: bool = False,
    ) -> None:
        """Write ``k``, ``v`` (``[T, width]`` fp32, rows contiguous) to the flat caches
        (``[num_slots, width]`` contiguous, any dtype of :data:`KV_TYPES`: rounded to
        nearest) at ``slots`` (``[T]`` int64). ``parallel``: rows shared among the attention
        kernels' threads."""
        rows, width = k.shape
        self._lib.cache_write(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slots.data_ptr(),
            rows,
            width,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            self._threads() if parallel else 1,
            KV_TYPES[k_cache.dtype],
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One query per sequence against its paged context, into ``out``.

        Args:
            q: ``[n, H, D]``, heads contiguous within a row.
            k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` contiguous, a dtype of
                :data:`KV_TYPES`.
            block_tables: ``[n, max_blocks]`` int32, row-contiguous.
            context_lens: ``[n]`` int32 contiguous, each >= 1.
            out: ``[n, H, D]``, heads contiguous within a row.

        Raises:
            MemoryError: the kernel could not allocate its scores.
        """
        n, heads, d = q.shape
        _, bs, kv_heads, _ = k_cache.shape
        rc = self._lib.decode_attention(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            n,
            heads,
            kv_heads,
            d,
            bs,
            scale,
            out.data_ptr(),
            out.stride(0),
            self._threads(),
            KV_TYPES[k_cache.dtype],
        )
        if rc:
            raise MemoryError("decode_attention: no memory for the attention scores")

    def _threads(self) -> int:
        return torch.get_num_threads() if self.parallel else 1

    def address(self, name: str) -> int:
        """The address of kernel ``name``, for C code that calls it
        (``engine/quant/decode.c``)."""
        return ctypes.cast(getattr(self._lib, name), ctypes.c_void_p).value

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        first: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of the step's sequences ``first..B-1`` (prefill chunks, their
        K/V already in the cache) on the paged cache, into their rows of ``out``.

        Args:
            q, out: ``[T, H, D]``, heads contiguous within a row; ``D`` a multiple of 64.
            k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` contiguous, a dtype of
                :data:`KV_TYPES`.
            block_tables: ``[B, max_blocks]`` int32, row-contiguous.
            query_start_loc: ``[B + 1]`` int32, each sequence's first row in ``q``.
            context_lens: ``[B]`` int32, each sequence's tokens after this step.

        Raises:
            MemoryError: the kernel could not allocate its scratch.
            ValueError: ``D`` is not a multiple of 64.
        """
        _, heads, d = q.shape
        _, bs, kv_heads, _ = k_cache.shape
        rc = self._lib.prefill_attention(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            query_start_loc.data_ptr(),
            context_lens.data_ptr(),
            first,
            len(context_lens) - first,
            heads,
            kv_heads,
            d,
            bs,
            scale,
            out.data_ptr(),
            out.stride(0),
            self._threads(),
            KV_TYPES[k_cache.dtype],
        )
        if rc == -2:
            raise ValueError(f"prefill_attention: head_dim {d} is not a multiple of 64")
        if rc:
            raise MemoryError("prefill_attention: no memory for the attention scratch")


def _cpu_key() -> str:
    """What the compiled code depends on besides the source: compiler and CPU."""
    try:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        cc = ""
    try:
        cpu = "".join(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("model name", "flags"))
        )
    except OSError:
        cpu = ""
    return cc + cpu


def build(out_dir: Path) -> tuple[Path, bool]:
    """Compile the kernels into ``out_dir`` (once per source, flags, compiler and CPU), with
    OpenMP where the compiler has it: ``(library, with OpenMP)``.

    Raises:
        OSError, subprocess.CalledProcessError: no compiler, or compilation failed.
    """
    units = [CompileUnit(src) for src in SOURCES]
    try:
        return compile_library(out_dir, "cpu_kernels", units, HEADERS, (*FLAGS, OPENMP_FLAG)), True
    except subprocess.CalledProcessError as e:
        logger.warning("CPU kernels without OpenMP (attention on one thread): %s", e.stderr)
        return compile_library(out_dir, "cpu_kernels", units, HEADERS, FLAGS), False


@dataclass(frozen=True)
class CompileUnit:
    """One object of a library: a C source and the flags it alone is compiled with (an
    instruction set and a symbol suffix, where one source is compiled once per target)."""

    source: Path
    flags: tuple[str, ...] = ()


def compile_library(
    out_dir: Path,
    name: str,
    units: list[CompileUnit],
    headers: tuple[Path, ...],
    flags: tuple[str, ...],
) -> Path:
    """Compile ``units`` with ``flags`` (plus each unit's own) and link them into
    ``out_dir/<name>-<key>.so``, once per sources, flags, compiler and CPU.

    Raises:
        OSError, subprocess.CalledProcessError: no compiler, or compilation failed.
    """
    code = b"".join(p.read_bytes() for p in (*{u.source for u in units}, *headers))
    recipe = " ".join(flags) + " | linked without " + " ".join(FAST_MATH_FLAGS)
    recipe += "".join(f" | {u.source.name}: {' '.join(u.flags)}" for u in units)
    h = hashlib.sha256(code + recipe.encode() + _cpu_key().encode())
    target = out_dir / f"{name}-{h.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build.", dir=out_dir))
    try:
        so = tmp / target.name
        # Compiled with ``flags``, linked without ``-ffast-math``: linked with it, GCC (before
        # 13, even with -shared) adds crtfastmath.o, whose constructor turns on flush-to-zero
        # and denormals-are-zero in the loading thread, changing every float operation of the
        # process (numpy's, torch's, the caller's) on subnormals.
        objects = []
        compile_flags = [f for f in flags if f != "-shared"]
        for i, unit in enumerate(units):
            obj = tmp / f"{i}-{unit.source.stem}.o"
            _cc([*compile_flags, *unit.flags, "-c", str(unit.source), "-o", str(obj)])
            objects.append(str(obj))
        link_flags = [f for f in flags if f not in FAST_MATH_FLAGS]
        _cc([*link_flags, *objects, "-o", str(so), "-lm"])
        os.replace(so, target)  # atomic: a concurrent build of the same key is identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _cc(args: list[str]) -> None:
    subprocess.run(["cc", *args], check=True, capture_output=True, text=True)


def open_library(
    build_fn: Callable[[Path], tuple[Path, bool]], unavailable: str
) -> tuple[ctypes.CDLL, bool] | None:
    """``build_fn(out_dir)`` into ``$ITERSERVE_CACHE/kernels``, then the library loaded:
    ``(library, with OpenMP)``; None where the kernels are turned off (``DISABLE_ENV``) or
    cannot be built (logged as ``unavailable``)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        path, openmp = build_fn(cache_dir() / "kernels")
        return ctypes.CDLL(str(path)), openmp
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("%s: %s", unavailable, detail)
        return None


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, or None where they are disabled or cannot be built (logged once)."""
    opened = open_library(build, "CPU kernels unavailable, using PyTorch ops instead")
    if opened is None:
        return None
    lib, openmp = opened
    runtimes = openmp_runtimes()
    if openmp and len(runtimes) > 1:
        logger.warning(
            "two OpenMP runtimes in this process (%s): the attention kernels run on one thread",
            ", ".join(sorted(runtimes)),
        )
    return CpuKernels(lib, parallel=openmp and len(runtimes) <= 1)


def openmp_runtimes() -> set[str]:
    """Files of the OpenMP runtimes (GNU, LLVM, Intel) mapped into this process (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {
        os.path.realpath(line.split()[-1])
        for line in maps.splitlines()
        if re.search(r"/lib[gi]?omp[^/]*\.so", line)
    }
