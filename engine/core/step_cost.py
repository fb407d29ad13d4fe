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

A step that runs LoRA adapters costs more (:func:`lora_seconds`): each of a decoder layer's
four fused projections adds two matrix products over the step's rows and the slots in use
(:mod:`engine.lora`), and a decode-only step with an adapter leaves the packed weights'
one-call decode path. Calibration runs no adapter, so those terms are not fitted: they are
set from a measurement (``lora_token_s``, ``lora_step_s``; 0 by default).
"""

from __future__ import annotations

import itertools
import json
import math
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
    adapters: int = 0
    """Distinct LoRA adapters among the step's sequences (0: the base model alone)."""

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        """The shape of a scheduler's step (decodes come first in ``out.seqs``)."""
        adapters = len({s.request.lora.name for s in out.seqs if s.request.lora is not None})
        return cls.of_spans([(s.start, s.num_tokens) for s in out.seqs], out.num_decodes, adapters)

    @classmethod
    def of_record(cls, seqs: tuple[tuple[str, int, int], ...], num_decodes: int) -> StepShape:
        """The shape from a :class:`engine.core.interfaces.StepRecord`'s ``seqs`` (id, start,
        tokens), decodes first."""
        return cls.of_spans([(start, n) for _, start, n in seqs], num_decodes)

    @classmethod
    def of_spans(
        cls, spans: list[tuple[int, int]], num_decodes: int, adapters: int = 0
    ) -> StepShape:
        """The shape of ``(first position, tokens)`` per scheduled sequence, the
        ``num_decodes`` decodes first, with ``adapters`` distinct LoRA adapters."""
        decodes, prefills = spans[:num_decodes], spans[num_decodes:]
        return cls(
            prefill_tokens=sum(n for _, n in prefills),
            decode_seqs=len(decodes),
            decode_context_tokens=sum(start + 1 for start, _ in decodes),
            prefill_attention_pairs=sum(n * start + n * (n + 1) / 2 for start, n in prefills),
            prefill_seqs=len(prefills),
            adapters=adapters,
        )

    @property
    def tokens(self) -> int:
        """The step's rows: prefill tokens and one per decode."""
        return self.prefill_tokens + self.decode_seqs

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


def lora_seconds(shape: StepShape, token_s: float, step_s: float, adapter_s: float = 0.0) -> float:
    """The seconds a step's LoRA adapters add:
    ``adapters x (adapter_s + token_s x tokens) + step_s`` for a step with any adapter, 0
    for one without.

    Each fused projection's two extra matrix products span the step's ``tokens`` rows
    and ``adapters x targets x max_lora_rank`` columns (the slots in use; the engine's
    slots may reach past the distinct adapters' count, which this leaves out), and read
    every adapter's matrices once (``adapter_s``); ``step_s`` is what a step pays for
    having any (the rows' slot matrix, and a decode-only step running the model's layers
    instead of the packed weights' one-call decode path).
    """
    if not shape.adapters:
        return 0.0
    return shape.adapters * (adapter_s + token_s * shape.tokens) + step_s


def check_lora_terms(token_s: float, step_s: float, adapter_s: float = 0.0) -> None:
    """Raises:
    ValueError: a LoRA term that is not a finite number >= 0.
    """
    terms = (("lora_token_s", token_s), ("lora_step_s", step_s), ("lora_adapter_s", adapter_s))
    for name, value in terms:
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} {value!r}: must be a finite number of seconds >= 0")


@dataclass(frozen=True, slots=True)
class LinearCost:
    """``seconds = coefficients . shape.features()``, fitted on one machine.

    ``num_kv_blocks``, ``block_size``, ``max_model_len`` and ``vocab_size`` are those of the
    engine it was measured on, so a simulated replica has the same KV capacity.

    ``lora_token_s``, ``lora_adapter_s`` and ``lora_step_s`` price a step's LoRA adapters
    (:func:`lora_seconds`); the fit does not set them, and a file without them reads them
    as 0.

    Raises:
        ValueError: a LoRA term that is negative or not finite.
    """

    coefficients: tuple[float, ...]
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    source: str = ""
    """Where the fit came from (model, host, steps, fit error), for reports."""
    lora_token_s: float = 0.0
    """Seconds per step row (token) per distinct LoRA adapter in the step."""
    lora_step_s: float = 0.0
    """Seconds a step with any LoRA adapter adds."""
    lora_adapter_s: float = 0.0
    """Seconds per distinct LoRA adapter in the step (reading its matrices)."""

    def __post_init__(self) -> None:
        check_lora_terms(self.lora_token_s, self.lora_step_s, self.lora_adapter_s)

    def step_seconds(self, shape: StepShape) -> float:
        base = float(sum(c * f for c, f in zip(self.coefficients, shape.features())))
        return base + lora_seconds(shape, self.lora_token_s, self.lora_step_s, self.lora_adapter_s)

    def save(self, path: str | Path) -> None:
        data = asdict(self) | {"kind": "linear", "features": list(FEATURES)}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearCost:
        """Read a fit written by :meth:`save` (``iterserve calibrate``).

        Raises:
            ValueError: not a linear cost model file, its features differ, or a LoRA
                term is negative or not a number.
        """
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "linear" or tuple(data.get("features", ())) != FEATURES:
            raise ValueError(f"{path}: not a calibrated cost model (iterserve calibrate)")
        try:
            return cls(
                tuple(data["coefficients"]),
                data["num_kv_blocks"],
                data["block_size"],
                data["max_model_len"],
                data["vocab_size"],
                data.get("source", ""),
                data.get("lora_token_s", 0.0),
                data.get("lora_step_s", 0.0),
                data.get("lora_adapter_s", 0.0),
            )
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


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
