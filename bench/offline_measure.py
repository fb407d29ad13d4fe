"""What every offline throughput worker (``bench/offline_workers.py``, ``bench/offline_hf.py``)
measures in its own subprocess: the timed section's wall time and CPU load, resident memory,
and the result it hands back to ``bench/engine_throughput.py``.
"""

from __future__ import annotations

import os
import resource
import sys
import time

from cpu_load import cpu_snapshot, foreign_cores


def peak_rss_mib() -> float:
    """Peak resident set of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def rss_mib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


class Timed:
    """Context manager: wall seconds and other processes' CPU load over a timed section."""

    def __enter__(self):
        self.snap = cpu_snapshot()
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t
        end = cpu_snapshot()
        self.foreign = foreign_cores(self.snap, end, self.wall)
        # cores this process kept busy (all its threads): how parallel the system really ran
        self.own = (end[1] - self.snap[1]) / self.wall if self.snap and end else None
        return False


def set_threads(cfg: dict) -> None:
    import torch

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])


def make_result(wl: dict, wall: float, tokens: list[list[int]], **extra) -> dict:
    """A worker's result: throughput over ``wall``, after checking every request got exactly
    its output length."""
    lens = wl["output_lens"]
    bad = [i for i, (t, n) in enumerate(zip(tokens, lens)) if len(t) != n]
    if bad:
        i = bad[0]
        raise RuntimeError(
            f"{len(bad)} requests got the wrong number of tokens "
            f"(request {i}: {len(tokens[i])} instead of {lens[i]})"
        )
    out_tok = sum(lens)
    prompt_tok = sum(len(p) for p in wl["prompts"])
    return {
        "wall_s": wall,
        "output_tokens": out_tok,
        "prompt_tokens": prompt_tok,
        "output_tok_s": out_tok / wall,
        "total_tok_s": (out_tok + prompt_tok) / wall,
        "token_ids": tokens,
        **extra,
    }
