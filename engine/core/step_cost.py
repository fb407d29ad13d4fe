"""The step-cost model: how long one scheduled step takes, linear in its composition.

A step's cost depends on its composition (:class:`StepShape`): prefill tokens, decode
sequences, and the context each attends. :class:`LinearCost` says its seconds are linear in
the shape's five features (:meth:`StepShape.features`), fitted by non-negative least squares
(:func:`fit_linear`) to steps the real engine ran (``iterserve calibrate``:
:mod:`deploy.sim.calibrate`). Unlike the admission model's ``a + b * prefill + c * decodes``
(:mod:`policies.step_time`), it sees attention, whose cost grows with the context.

The simulator costs its virtual steps with it (:mod:`deploy.sim`; GPUs the project cannot
measure take :class:`deploy.sim.roofline.RooflineCost` instead); a live replica predicts its
own steps with it (:mod:`engine.core.step_drift`). It is a pure function of the shape, so a
simulated run is deterministic.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.core.schedule_output import SchedulerOutput

FEATURES = (
    "step",
    "prefill_tokens",
    "decode_seqs",
    "decode_context_tokens",
    "prefill_attention_ktokens",
)
"""The names of :meth:`StepShape.features`, in order (``LinearCost`` coefficients too)."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes.

    ``decode_context_tokens`` is the sum over decodes of the tokens each attends (its
    context, the new token included). ``prefill_attention_pairs`` is the sum over prefill
    chunks of query-key pairs under the causal mask: a chunk of ``n`` tokens starting at
    position ``s`` attends ``n * s + n * (n + 1) / 2`` pairs.
    """

    prefill_tokens: int
    decode_seqs: int
    decode_context_tokens: int
    prefill_attention_pairs: float
    prefill_seqs: int

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        """The shape of a scheduler's step (decodes come first in ``out.seqs``)."""
        return cls.of_spans([(s.start, s.num_tokens) for s in out.seqs], out.num_decodes)

    @classmethod
    def of_record(cls, seqs: tuple[tuple[str, int, int], ...], num_decodes: int) -> StepShape:
        """The shape from a :class:`engine.core.interfaces.StepRecord`'s ``seqs`` (id, start,
        tokens), decodes first."""
        return cls.of_spans([(start, n) for _, start, n in seqs], num_decodes)

    @classmethod
    def of_spans(cls, spans: list[tuple[int, int]], num_decodes: int) -> StepShape:
        """The shape of ``(first position, tokens)`` per scheduled sequence, the
        ``num_decodes`` decodes first."""
        decodes, prefills = spans[:num_decodes], spans[num_decodes:]
        return cls(
            prefill_tokens=sum(n for _, n in prefills),
            decode_seqs=len(decodes),
            decode_context_tokens=sum(start + 1 for start, _ in decodes),
            prefill_attention_pairs=sum(n * start + n * (n + 1) / 2 for start, n in prefills),
            prefill_seqs=len(prefills),
        )

    def features(self) -> tuple[float, ...]:
        """``(1, prefill tokens, decodes, decode context tokens, prefill attention pairs /
        1000)``: the regressors of :class:`LinearCost`."""
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.decode_seqs),
            float(self.decode_context_tokens),
            self.prefill_attention_pairs / 1000.0,
        )


class CostModel(Protocol):
    """Seconds one step of a given shape takes."""

    def step_seconds(self, shape: StepShape) -> float: ...


@dataclass(frozen=True, slots=True)
class LinearCost:
    """``seconds = coefficients . shape.features()``, fitted on one machine.

    ``num_kv_blocks``, ``block_size``, ``max_model_len`` and ``vocab_size`` are those of the
    engine it was measured on, so a simulated replica has the same KV capacity.
    """

    coefficients: tuple[float, ...]
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    source: str = ""
    """Where the fit came from (model, host, steps, fit error), for reports."""

    def step_seconds(self, shape: StepShape) -> float:
        return float(sum(c * f for c, f in zip(self.coefficients, shape.features())))

    def save(self, path: str | Path) -> None:
        data = asdict(self) | {"kind": "linear", "features": list(FEATURES)}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearCost:
        """Read a fit written by :meth:`save` (``iterserve calibrate``).

        Raises:
            ValueError: not a linear cost model file, or its features differ.
        """
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "linear" or tuple(data.get("features", ())) != FEATURES:
            raise ValueError(f"{path}: not a calibrated cost model (iterserve calibrate)")
        return cls(
            tuple(data["coefficients"]),
            data["num_kv_blocks"],
            data["block_size"],
            data["max_model_len"],
            data["vocab_size"],
            data.get("source", ""),
        )


def fit_linear(shapes: list[StepShape], seconds: list[float]) -> tuple[float, ...]:
    """Non-negative least squares of ``seconds`` on the shapes' features, in relative
    error: each step's residual is divided by its measured time.

    Relative, because steps span decodes of tens of milliseconds to second-long prefills:
    on absolute residuals the few long steps set the fit, and short decode steps are
    predicted far too long. Exact for five features: weighted least squares on every subset
    of free coefficients (the rest held at 0), keeping the feasible one with the least
    error.

    Raises:
        ValueError: fewer steps than features, lengths differ, or a time is not positive.
    """
    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise ValueError(
            f"{len(shapes)} shapes and {len(seconds)} times: need equal "
            f"counts of at least {len(FEATURES)}"
        )
    y = np.array(seconds, dtype=float)
    if not np.all(y > 0):
        raise ValueError("every step time must be positive")
    x = np.array([s.features() for s in shapes]) / y[:, None]
    target = np.ones(len(y))
    best, best_err = np.zeros(len(FEATURES)), float(len(y))
    for k in range(1, len(FEATURES) + 1):
        for cols in itertools.combinations(range(len(FEATURES)), k):
            coef, *_ = np.linalg.lstsq(x[:, cols], target, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((x[:, cols] @ coef - target) ** 2))
            if err < best_err:
                best = np.zeros(len(FEATURES))
                best[list(cols)] = coef
                best_err = err
    return tuple(float(c) for c in best)
