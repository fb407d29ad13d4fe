"""The command line every suite shares: its parser, the flags several suites take, and the
expected duration each prints before it starts.

A suite's ``main`` builds its parser with :func:`parser` (``prog`` the command that runs it,
the description the first paragraph of its module docstring), adds the shared flags it takes
with the ``add_*`` helpers (one name, type, default and help each, wherever they appear) and
then its own, and calls :func:`expected` before its first measurement.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m COMMAND`` (``command``: ``bench.storm``, ``bench.batch
    throughput``), described by the first paragraph of ``doc``."""
    first = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(prog=f"python -m {command}", description=" ".join(first.split()))


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers (``--rates 1,2.5,3``)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers, comma-separated: {text!r}") from None


def names(text: str) -> list[str]:
    """A comma-separated list of names (``--systems vllm,iterserve``)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def add_quick(p: argparse.ArgumentParser, what: str) -> None:
    """``--quick``: a smoke run, ``what`` says how small."""
    p.add_argument("--quick", action="store_true", help=what)


def add_out(
    p: argparse.ArgumentParser, default: str | Path | None, what: str, type: type = str
) -> None:
    """``--out``: where the result goes (``what``: a file, a stem, a folder)."""
    p.add_argument("--out", type=type, default=default, help=what)


def add_seed(p: argparse.ArgumentParser) -> None:
    """``--seed``: what every random draw of the workload derives from (default 0)."""
    p.add_argument("--seed", type=int, default=0)


def add_trace(p: argparse.ArgumentParser, type: type = str) -> None:
    """``--trace``: the trace file (default the shipped conversation trace)."""
    from bench.toolkit.workload import TRACE  # the GPU check's machine lacks what it imports

    p.add_argument("--trace", type=type, default=type(TRACE), help="the trace CSV")


def add_window_start(p: argparse.ArgumentParser, default: int) -> None:
    """``--window-start``: the first trace row of the window replayed."""
    p.add_argument("--window-start", type=int, default=default, help="first trace row")


def add_slos(p: argparse.ArgumentParser, ttft_s: float, tpot_s: float) -> None:
    """``--slo-ttft-s`` and ``--slo-tpot-s``: the SLOs every request is judged by (seconds)."""
    p.add_argument("--slo-ttft-s", type=float, default=ttft_s, help="TTFT SLO (s)")
    p.add_argument("--slo-tpot-s", type=float, default=tpot_s, help="TPOT SLO (s)")


def expected(tag: str, seconds: float, detail: str = "") -> None:
    """Print the run's expected duration (``[tag] expected duration: about N min``), with
    ``detail`` in parentheses after it, before anything is measured."""
    minutes = max(1, round(seconds / 60))
    more = f" ({detail})" if detail else ""
    print(f"[{tag}] expected duration: about {minutes} min{more}", flush=True)
