"""The trace reader every benchmark shares: a window of rows, lengths scaled, arrivals rescaled.

Traces: ``deploy/sim/traces/azure_llm_2023_conv.csv`` (or ``_code.csv``), shipped with the package,
the Azure LLM inference trace 2023 (columns TIMESTAMP, ContextTokens, GeneratedTokens),
published with Splitwise (Patel et al., ISCA 2024) under CC-BY 4.0.

Offered load is varied only by rescaling time: a window of N requests replayed at R req/s
keeps the trace's own inter-arrival pattern (bursts included), stretched or squeezed so that
the row after the window would arrive at exactly N / R seconds. The trace's first seconds
are lighter than its mean rate, so scaling by the mean would under-offer.
"""

from __future__ import annotations

import csv
import itertools
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from deploy.sim.trace import trace_path

TRACE = trace_path("conv")
ATTRIBUTION = (
    "Azure LLM inference trace 2023 (conversation), CC-BY 4.0, from Splitwise: Patel, Choukse, "
    "Zhang, Shah, Goiri, Maleki, Bianchini, ISCA 2024 (Azure/AzurePublicDataset)"
)
TOKEN_ID_RANGE = (1000, 40000)
"""Prompt token ids for in-process runs are drawn uniformly from this range: ordinary
vocabulary, clear of special tokens."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One trace row: its index, seconds since the window's first row, and its lengths."""

    row: int
    offset_s: float
    timestamp: str
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class Lengths:
    """How trace lengths are scaled down to this machine (divide, round, clamp; tokens)."""

    prompt_divisor: float = 8.0
    output_divisor: float = 8.0
    min_prompt: int = 4
    max_prompt: int = 1024
    min_output: int = 1
    max_output: int = 512

    def prompt(self, context_tokens: int) -> int:
        return min(
            max(self.min_prompt, round(context_tokens / self.prompt_divisor)), self.max_prompt
        )

    def output(self, generated_tokens: int) -> int:
        return min(
            max(self.min_output, round(generated_tokens / self.output_divisor)), self.max_output
        )

    def describe(self) -> str:
        return (
            f"prompt = round(ContextTokens / {self.prompt_divisor:g}) clamped to "
            f"[{self.min_prompt}, {self.max_prompt}], output = round(GeneratedTokens / "
            f"{self.output_divisor:g}) clamped to [{self.min_output}, {self.max_output}]"
        )


def read_trace(path: str | Path, start: int, n: int) -> list[TraceRow]:
    """Rows ``start .. start + n`` (the extra row, when the trace has it, ends the span).

    Raises:
        ValueError: the trace has fewer than ``n`` rows from ``start``.
    """
    with open(path, newline="") as f:
        rows = list(itertools.islice(csv.DictReader(f), start, start + n + 1))
    if len(rows) < n:
        raise ValueError(f"{path} has {len(rows)} rows from row {start}; {n} needed")
    t0 = datetime.fromisoformat(rows[0]["TIMESTAMP"])
    return [
        TraceRow(
            start + i,
            (datetime.fromisoformat(r["TIMESTAMP"]) - t0).total_seconds(),
            r["TIMESTAMP"],
            int(r["ContextTokens"]),
            int(r["GeneratedTokens"]),
        )
        for i, r in enumerate(rows)
    ]


def arrival_offsets(rows: list[TraceRow], n: int, rate: float) -> tuple[list[float], float]:
    """Send times (s from the start) of ``rows[:n]`` offered at ``rate`` req/s, and the scale.

    Trace time is multiplied by one factor so that ``rows[n]`` (or, without it, one mean gap
    after the last) would arrive at ``n / rate``: the offered rate is exactly ``rate``.
    """
    base = rows[0].offset_s
    if len(rows) > n:
        span = rows[n].offset_s - base
    else:
        span = (rows[n - 1].offset_s - base) * n / max(1, n - 1)
    if span <= 0:  # every row at one instant: even spacing
        return [i / rate for i in range(n)], 0.0
    scale = n / rate / span
    return [(r.offset_s - base) * scale for r in rows[:n]], scale


def pick_class(mix: dict[str, float] | None, seed: int, row: int) -> str | None:
    """A row's traffic class drawn from ``mix`` (name -> weight), the same at every rate."""
    if not mix:
        return None
    x = random.Random(f"{seed}:class:{row}").random() * sum(mix.values())
    name = None
    for name, weight in mix.items():
        x -= weight
        if x < 0:
            return name
    return name


def token_ids(seed: int, row: int, n: int, replay: int = 0) -> list[int]:
    """``n`` prompt token ids for ``row``, deterministic; another ``replay`` gives others."""
    rng = random.Random(f"{seed}:ids:{replay}:{row}")
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]


class Window:
    """A trace window made into in-process requests: token-id prompts, scaled lengths, classes.

    Each row keeps its prompt, length and class at every rate (``token_ids``,
    ``pick_class``), so configs and loads see the same requests.
    """

    def __init__(
        self,
        trace: str | Path,
        start: int,
        rows: int,
        lengths: Lengths,
        mix: dict[str, float] | None,
        seed: int = 0,
    ) -> None:
        self.rows = read_trace(trace, start, rows)
        self.lengths = lengths
        self.mix = mix
        self.seed = seed
        self.max_row_used = start

    def request(self, i: int, tag: str, arrival_s: float = 0.0, cls: str | None = None):
        """The window's ``i``-th row as a :class:`loadgen.LoadRequest` (``cls`` overrides)."""
        from bench.toolkit.loadgen import LoadRequest

        r = self.rows[i]
        p = self.lengths.prompt(r.context_tokens)
        return LoadRequest(
            f"{tag}-r{r.row}",
            r.row,
            cls or pick_class(self.mix, self.seed, r.row),
            token_ids(self.seed, r.row, p),
            p,
            self.lengths.output(r.generated_tokens),
            arrival_s,
        )

    def at_rate(
        self, rate: float, duration_s: float, tag: str, start: int = 0, cls: str | None = None
    ) -> tuple[list, float]:
        """The ``round(rate * duration_s)`` requests from index ``start``, arrivals rescaled
        (:func:`arrival_offsets`); returns (requests, time scale).

        Raises:
            SystemExit: the window is too short for that many requests.
        """
        n = max(1, round(rate * duration_s))
        if start + n >= len(self.rows):
            raise SystemExit(
                f"the trace window has {len(self.rows)} rows; {rate} req/s for "
                f"{duration_s} s needs {start + n + 1}"
            )
        offsets, scale = arrival_offsets(self.rows[start : start + n + 1], n, n / duration_s)
        self.max_row_used = max(self.max_row_used, self.rows[start + n - 1].row)
        return [self.request(start + k, tag, at, cls) for k, at in enumerate(offsets)], scale

    def mean_lengths(self, n: int) -> tuple[float, float]:
        """Mean (prompt, output) tokens of the first ``n`` rows."""
        reqs = [self.request(i, "mean") for i in range(n)]
        return (sum(r.prompt_tokens for r in reqs) / n, sum(r.max_tokens for r in reqs) / n)
