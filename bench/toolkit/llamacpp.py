"""llama.cpp's ``llama-server`` (and ``llama-quantize``), built from the ``llama-cpp-python``
source distribution on the package index, for side-by-side benchmarks only.

The sdist carries llama.cpp's source as ``vendor/llama.cpp``; :func:`ensure_built` downloads
it (``pip download --no-deps``), builds the two targets with CMake into the ignored folder
``.llamacpp/`` and reuses them after: nothing is downloaded while a benchmark runs. Build
it ahead with ``make llamacpp`` or ``python -m bench.toolkit.llamacpp`` (about 5 minutes on
2 cores).

Flags: native off and AMX off, AVX2/FMA/F16C/AVX-512 on. On the virtual machines these
benchmarks run on, ``GGML_NATIVE=ON`` and the AMX flags build a binary that dies with an
invalid opcode; the flags name the instruction sets instead. No CURL (no model downloads).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.toolkit import REPO

VERSION = "0.3.36"
"""``llama-cpp-python`` version whose vendored llama.cpp is built."""
HOME = REPO / ".llamacpp"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
)
TARGETS = ("llama-server", "llama-quantize")
EXPECTED_BUILD_S = 300


def build_dir() -> Path:
    return HOME / f"llama-cpp-python-{VERSION}" / "build"


def binary(name: str) -> Path:
    """The built ``name`` (one of :data:`TARGETS`); it may not exist yet."""
    return build_dir() / "bin" / name


def built() -> bool:
    stamp = build_dir() / "iterserve-build.txt"
    return (
        all(binary(t).is_file() for t in TARGETS)
        and stamp.is_file()
        and (stamp.read_text() == " ".join(CMAKE_FLAGS))
    )


def ensure_built(jobs: int | None = None) -> Path:
    """Build ``llama-server`` and ``llama-quantize`` once; the folder of the binaries.

    Raises:
        RuntimeError: the download or the build failed (its output's tail in the message).
    """
    if built():
        return binary(TARGETS[0]).parent
    print(
        f"[llamacpp] building llama.cpp from llama-cpp-python {VERSION} into {HOME} "
        f"(once; about {EXPECTED_BUILD_S // 60} min on 2 cores)",
        flush=True,
    )
    t0 = time.monotonic()
    src = build_dir().parent
    if not (src / "CMakeLists.txt").is_file():
        HOME.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=HOME) as tmp:
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"llama-cpp-python=={VERSION}",
                    "-d",
                    tmp,
                ]
            )
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            vendored = Path(tmp) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
            shutil.rmtree(src, ignore_errors=True)
            shutil.move(str(vendored), src)
    jobs = jobs or os.cpu_count() or 1
    _run(["cmake", "-S", str(src), "-B", str(build_dir()), *CMAKE_FLAGS])
    _run(["cmake", "--build", str(build_dir()), "--target", *TARGETS, "-j", str(jobs)])
    (build_dir() / "iterserve-build.txt").write_text(" ".join(CMAKE_FLAGS))
    print(f"[llamacpp] built in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    return binary(TARGETS[0]).parent


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(
            f"{' '.join(cmd[:4])} ... failed:\n{(done.stdout + done.stderr)[-3000:]}"
        )


def quantize(src: Path, out: Path, kind: str) -> Path:
    """``llama-quantize --allow-requantize src out kind`` (once: an existing ``out`` is kept);
    ``out``.

    Raises:
        RuntimeError: the tool failed.
    """
    if not out.is_file():
        ensure_built()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        _run([str(binary("llama-quantize")), "--allow-requantize", str(src), str(tmp), kind])
        tmp.replace(out)
    return out


def server_command(
    gguf: Path, port: int, threads: int, parallel: int, ctx: int, alias: str
) -> list[str]:
    """``llama-server`` on ``gguf``: ``threads`` for generation and batches, ``parallel``
    slots sharing ``ctx`` tokens of context, the model served as ``alias``."""
    return [
        str(binary("llama-server")),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--parallel",
        str(parallel),
        "-c",
        str(ctx),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--alias",
        alias,
    ]


if __name__ == "__main__":
    print(ensure_built())
