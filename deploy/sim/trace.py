"""Traces for the simulator: the Azure CSVs or JSONL, windowed, rescaled, classed.

CSV: the Azure LLM inference trace 2023 (columns ``TIMESTAMP``, ``ContextTokens``,
``GeneratedTokens``; Splitwise, Patel et al., ISCA 2024, CC-BY 4.0), as in
``../shared/traces/``. JSONL: one request a line, ``{"arrival_s", "prompt_tokens",
"output_tokens", "class"?}`` (``class`` optional: the mix, or the default class, decides).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to replay: when it arrives (s from the window's start) and its sizes."""

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    traffic_class: str


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Which part of a trace to replay, and how.

    ``window_start_s`` and ``duration_s`` select arrivals in trace time; ``rate_scale``
    multiplies the arrival rate (times are divided by it); lengths are divided by
    ``length_scale`` (at least 1 token each); ``mix`` draws a class per request (name ->
    weight; the draw depends only on ``seed`` and the request's row), else ``default_class``.
    """

    path: str
    window_start_s: float = 0.0
    duration_s: float | None = None
    rate_scale: float = 1.0
    length_scale: float = 1.0
    mix: tuple[tuple[str, float], ...] = ()
    default_class: str = "standard"
    seed: int = 0


def _rows(path: Path) -> list[tuple[float, int, int, str | None]]:
    """``(arrival s from the trace's first row, prompt, output, class or None)`` per row."""
    if path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    rows.append((float(d["arrival_s"]), int(d["prompt_tokens"]),
                                 int(d["output_tokens"]), d.get("class")))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a trace line ({e})") from e
        rows.sort(key=lambda r: r[0])
        t0 = rows[0][0] if rows else 0.0
        return [(t - t0, p, o, c) for t, p, o, c in rows]
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        try:
            raw = [(datetime.fromisoformat(r["TIMESTAMP"]), int(r["ContextTokens"]),
                    int(r["GeneratedTokens"])) for r in reader]
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: not an Azure trace CSV ({e})") from e
    t0 = raw[0][0] if raw else None
    return [((t - t0).total_seconds(), p, o, None) for t, p, o in raw]


def _pick(mix: tuple[tuple[str, float], ...], seed: int, row: int) -> str:
    x = random.Random(f"{seed}:class:{row}").random() * sum(w for _, w in mix)
    for name, weight in mix:
        x -= weight
        if x < 0:
            return name
    return mix[-1][0]


def load_requests(spec: TraceSpec) -> list[SimRequest]:
    """The window's requests, arrivals from 0 and rescaled, lengths scaled, classes set.

    Raises:
        ValueError: unreadable trace, a bad scale, or no request in the window.
        OSError: the file cannot be read.
    """
    if spec.rate_scale <= 0 or spec.length_scale <= 0:
        raise ValueError("rate_scale and length_scale must be > 0")
    end = (spec.window_start_s + spec.duration_s if spec.duration_s is not None
           else float("inf"))
    out = []
    for row, (t, prompt, output, cls) in enumerate(_rows(Path(spec.path))):
        if not spec.window_start_s <= t < end:
            continue
        if cls is None:
            cls = _pick(spec.mix, spec.seed, row) if spec.mix else spec.default_class
        out.append(SimRequest(
            f"r{row}", (t - spec.window_start_s) / spec.rate_scale,
            max(1, round(prompt / spec.length_scale)),
            max(1, round(output / spec.length_scale)), cls))
    if not out:
        raise ValueError(f"{spec.path}: no request between {spec.window_start_s} s and "
                         f"{end} s of trace time")
    return out


def parse_mix(text: str | None) -> tuple[tuple[str, float], ...]:
    """``"interactive=0.7,batch=0.3"`` -> ``(("interactive", 0.7), ("batch", 0.3))``.

    Raises:
        ValueError: not ``name=weight`` pairs with positive weights.
    """
    if not text:
        return ()
    pairs = []
    for part in text.split(","):
        name, _, weight = part.partition("=")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not name.strip() or w <= 0:
            raise ValueError(f"--class-mix {text!r}: expected name=weight pairs, weights > 0")
        pairs.append((name.strip(), w))
    return tuple(pairs)
