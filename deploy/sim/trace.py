"""Traces for the simulator: the Azure CSVs or JSONL, windowed, rescaled, classed.

CSV: the Azure LLM inference trace 2023 (columns ``TIMESTAMP``, ``ContextTokens``,
``GeneratedTokens``; Splitwise, Patel et al., ISCA 2024, CC-BY 4.0). Two ship with the
package in ``deploy/sim/traces/`` (its README gives the source and attribution), named by
:data:`SHIPPED` (``conv``, ``code``). JSONL: one request a line, ``{"arrival_s",
"prompt_tokens", "output_tokens", "class"?, "prompt_key"?, "model"?}`` (``class`` optional:
the mix, or the default class, decides; ``prompt_key`` optional: lines with the same key
share their prompt, see :attr:`SimRequest.prompt_key`; ``model`` optional: a LoRA adapter's
name, see :attr:`SimRequest.model`).
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

SHIPPED = {"conv": "azure_llm_2023_conv.csv", "code": "azure_llm_2023_code.csv"}
"""Short names of the traces shipped as package data (``deploy/sim/traces/``)."""


def trace_path(name_or_path: str | Path) -> Path:
    """The file a ``--trace`` value names: a shipped trace's short name, else a path.

    Raises:
        FileNotFoundError: neither a shipped name nor an existing file.
    """
    if str(name_or_path) in SHIPPED:
        return Path(str(resources.files("deploy.sim") / "traces" / SHIPPED[str(name_or_path)]))
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {str(name_or_path)!r}: no such file, and not a shipped "
            f"trace ({', '.join(SHIPPED)})"
        )
    return path


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request to replay: when it arrives (s from the window's start) and its sizes.

    ``output_tokens`` is what it generates; ``max_tokens`` is what it asked for, which
    admission reads (None: ``output_tokens``). ``priority`` None: its class's default.
    """

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    traffic_class: str
    priority: int | None = None
    max_tokens: int | None = None
    prompt_key: str | None = None
    """Requests with the same key send the same prompt tokens, up to the shorter one's
    length (one system prompt, or one question asked many times), so prefix caching and
    prefix affinity apply between them; None: a prompt that shares no block."""
    model: str | None = None
    """The model it asks for, as a request's ``model``: a LoRA adapter's name, which the
    simulated replica runs it with (:class:`deploy.sim.runner.SimLoRAs`: no file is
    read); None, or the service's model name (``ServiceConfig.model_name()``): the base
    model."""


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


def _rows(path: Path) -> list[tuple[float, int, int, str | None, str | None, str | None]]:
    """``(arrival s from the trace's first row, prompt, output, class or None, prompt key
    or None, model or None)`` per row."""
    if path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    rows.append(
                        _checked(
                            float(d["arrival_s"]),
                            _count(d["prompt_tokens"]),
                            _count(d["output_tokens"]),
                            d.get("class"),
                            d.get("prompt_key"),
                            d.get("model"),
                        )
                    )
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: not a trace line ({e})") from e
        return _from_first(rows)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        try:
            raw = [
                (
                    datetime.fromisoformat(r["TIMESTAMP"]),
                    _count(r["ContextTokens"]),
                    _count(r["GeneratedTokens"]),
                )
                for r in reader
            ]
        except (KeyError, ValueError, TypeError) as e:  # TypeError: a short row
            raise ValueError(f"{path}: not an Azure trace CSV ({e})") from e
    ref = raw[0][0] if raw else None
    return _from_first([((t - ref).total_seconds(), p, o, None, None, None) for t, p, o in raw])


def _count(value) -> int:
    """A token count: a whole number >= 0 (a trace may hold outputs of 0 tokens).

    Raises:
        ValueError: negative or fractional; TypeError: not a number.
    """
    n = float(value)
    if not (math.isfinite(n) and n >= 0 and n == int(n)):
        raise ValueError(f"token count {value!r} is not a whole number >= 0")
    return int(n)


def _checked(t: float, prompt: int, output: int, cls, key, model) -> tuple:
    if not math.isfinite(t):
        raise ValueError(f"arrival_s {t!r} is not a finite number")
    if cls is not None and not isinstance(cls, str):
        raise ValueError(f"class {cls!r} is not a name")
    if key is not None and not isinstance(key, str):
        raise ValueError(f"prompt_key {key!r} is not a string")
    if model is not None and not (isinstance(model, str) and model):
        raise ValueError(f"model {model!r} is not a name")
    return t, prompt, output, cls, key, model


def _from_first(rows: list[tuple]) -> list[tuple]:
    """Rows in arrival order, times from the first arrival (a trace need not be sorted)."""
    rows = sorted(rows, key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0.0
    return [(t - t0, *rest) for t, *rest in rows]


def _pick(mix: tuple[tuple[str, float], ...], seed: int, row: int) -> str:
    x = random.Random(f"{seed}:class:{row}").random() * sum(w for _, w in mix)
    for name, weight in mix:
        x -= weight
        if x < 0:
            return name
    return mix[-1][0]


def load_requests(spec: TraceSpec) -> list[SimRequest]:
    """The window's requests, arrivals from 0 and rescaled, lengths scaled, classes set.

    ``spec.path`` is a shipped trace's short name (:data:`SHIPPED`) or a file.

    Raises:
        ValueError: unreadable trace, a bad scale, or no request in the window.
        OSError: the file cannot be read (FileNotFoundError: no such trace).
    """
    for flag, value in (("--rate-scale", spec.rate_scale), ("--length-scale", spec.length_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")
    end = spec.window_start_s + spec.duration_s if spec.duration_s is not None else float("inf")
    out = []
    for row, (t, prompt, output, cls, key, model) in enumerate(_rows(trace_path(spec.path))):
        if not spec.window_start_s <= t < end:
            continue
        if cls is None:
            cls = _pick(spec.mix, spec.seed, row) if spec.mix else spec.default_class
        out.append(
            SimRequest(
                f"r{row}",
                (t - spec.window_start_s) / spec.rate_scale,
                max(1, round(prompt / spec.length_scale)),
                max(1, round(output / spec.length_scale)),
                cls,
                prompt_key=key,
                model=model,
            )
        )
    if not out:
        raise ValueError(
            f"{spec.path}: no request between {spec.window_start_s} s and {end} s of trace time"
        )
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
