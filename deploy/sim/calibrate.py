"""Calibrate :class:`engine.core.step_cost.LinearCost` on this machine: run the real engine, fit.

The engine runs as a replica runs it, an :class:`engine.async_engine.AsyncLLMEngine`
streaming to clients on the same event loop. The sweep keeps ``c`` requests in flight
for ``c`` in :data:`CONCURRENCY` (closed loop), with prompt lengths log-uniform over
``[8, 1024]`` tokens and outputs uniform over ``[4, 48]``, so steps mix prefill chunks of
every size, decodes of every context length, and both together. Closed loops start a new
prompt whenever one finishes, so few of their steps are decode-only at high concurrency,
the steps a replay under open-loop load runs most; a decode phase per level
(:func:`_decode_phase`) adds them, so that the fit predicts decode-only steps from
steps of their kind. Requests sample at the default temperature, 1. A step's cost is its
period (:func:`periods`): the step itself (schedule, execute, detokenize) and what the
serving around it costs it: a fit on a bare ``LLMEngine.step`` loop would leave out the
CPU the event loop takes from the engine's cores while it feeds the streams. The fit
is over all but a warm-up; its error is reported on alternate steps held out of a second
fit.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import platform
import random
import statistics
import time

from engine.config import EngineConfig
from engine.core.interfaces import StepRecord
from engine.core.step_cost import FEATURES, LinearCost, StepShape, fit_linear
from engine.core.step_log import STEP_KINDS, LoggedStep, StepLog

CONCURRENCY = (1, 2, 4, 8, 16, 32)
WARMUP_STEPS = 5
DECODE_PROMPT_TOKENS = (8, 256)
DECODE_OUTPUT_TOKENS = (24, 64)
"""The decode phase's prompt (log-uniform) and output (uniform) token ranges: short
prompts, so most of its steps are decode-only."""
IDLE_GAP_S = 0.02
"""A gap between steps longer than this is idleness (the serving loop polls every
``engine.async_engine.IDLE_TICK_S``), not work."""


def _request(
    rng: random.Random,
    vocab: int,
    prompt: tuple[int, int] = (8, 1024),
    output: tuple[int, int] = (4, 48),
) -> tuple[list[int], int]:
    n = int(math.exp(rng.uniform(math.log(prompt[0]), math.log(prompt[1]))))
    return [rng.randrange(1000, min(vocab, 40000)) for _ in range(n)], rng.randint(*output)


def sweep(
    config: EngineConfig, steps_per_level: int, seed: int = 0, progress=print
) -> tuple[list[StepRecord], list[float], object]:
    """Run the real engine over the sweep: its step records (warm-up dropped), each
    step's period (seconds until the next step started, see :func:`periods`) and the
    engine.

    Raises:
        ModelLoadError: the model cannot be loaded.
    """
    from engine.async_engine import AsyncLLMEngine

    aeng = AsyncLLMEngine.from_config(config)
    records: list[StepRecord] = []
    aeng.engine.add_step_listener(records.append)  # on the engine's thread; list.append is atomic
    asyncio.run(_closed_loops(aeng, records, steps_per_level, random.Random(seed), progress))
    return records[WARMUP_STEPS:], periods(records)[WARMUP_STEPS:], aeng.engine


async def _closed_loops(
    aeng, records: list, steps_per_level: int, rng: random.Random, progress
) -> None:
    """Each level's clients stream requests back to back until the level has its steps
    (the requests in flight then finish)."""
    from engine import RequestOutputKind, SamplingParams

    ids = itertools.count()

    async def one(prompt: list[int], out: int) -> None:
        params = SamplingParams(
            max_tokens=out, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        async for _ in aeng.generate(
            {"prompt_token_ids": prompt}, params, request_id=f"cal-{next(ids)}"
        ):
            pass

    async def client(start: int) -> None:
        while len(records) - start < steps_per_level:
            await one(*_request(rng, aeng.engine.vocab_size))

    try:
        for level in CONCURRENCY:
            start, t0 = len(records), time.perf_counter()
            await asyncio.gather(*(client(start) for _ in range(level)))
            await _decode_phase(one, level, rng, aeng.engine.vocab_size)
            progress(
                f"  {level:>2} in flight: {len(records) - start} steps, "
                f"{time.perf_counter() - t0:.1f} s"
            )
    finally:
        await aeng.shutdown()


async def _decode_phase(one, level: int, rng: random.Random, vocab: int) -> None:
    """``level`` requests at once with short prompts and longer outputs: after their
    prefill, mostly decode-only steps of ``level`` sequences and falling."""
    await asyncio.gather(
        *(
            one(*_request(rng, vocab, DECODE_PROMPT_TOKENS, DECODE_OUTPUT_TOKENS))
            for _ in range(level)
        )
    )


def periods(records: list[StepRecord]) -> list[float]:
    """Seconds from each step's start to the next one's, which adds what the serving loop
    spends between steps (new requests, outputs to their streams) to the step itself;
    a step followed by more than :data:`IDLE_GAP_S` of idleness, and the last, count
    their own ``seconds`` only."""
    out = []
    for r, nxt in zip(records, records[1:] + [None]):
        gap = None if nxt is None else nxt.start - (r.start + r.seconds)
        out.append(r.seconds + gap if gap is not None and 0 <= gap < IDLE_GAP_S else r.seconds)
    return out


def _mape(cost: LinearCost, shapes: list[StepShape], seconds: list[float]) -> float:
    return statistics.fmean(abs(cost.step_seconds(s) - t) / t for s, t in zip(shapes, seconds))


def calibrate(
    config: EngineConfig, steps_per_level: int = 40, seed: int = 0, progress=print
) -> tuple[LinearCost, dict]:
    """Fit a :class:`LinearCost` to the sweep; also a summary with the held-out error.

    The hold-out: a fit on even steps, its mean absolute percentage error on odd ones.
    """
    records, seconds, engine = sweep(config, steps_per_level, seed, progress)
    shapes = [StepShape.of_record(r.seqs, r.num_decodes) for r in records]
    coef = fit_linear(shapes, seconds)
    kw = dict(
        num_kv_blocks=engine.block_manager.num_blocks,
        block_size=config.block_size,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
    )
    half = LinearCost(fit_linear(shapes[::2], seconds[::2]), **kw)
    summary = {
        "steps": len(records),
        "in_sample_mape": _mape(LinearCost(coef, **kw), shapes, seconds),
        "held_out_mape": _mape(half, shapes[1::2], seconds[1::2]),
        "coefficients": dict(zip(FEATURES, coef)),
    }
    source = (
        f"{engine.model_dir} {config.dtype} on {platform.node()} "
        f"({platform.processor() or platform.machine()}), {len(records)} steps, "
        f"held-out MAPE {summary['held_out_mape']:.1%}"
    )
    return LinearCost(coef, source=source, **kw), summary


def fit_log(log: StepLog, steps: list[LoggedStep] | None = None, source: str = "") -> LinearCost:
    """A :class:`LinearCost` fitted on a step log's steps (default: all), each costing its
    period (:attr:`engine.core.step_log.LoggedStep.period`), with the KV capacity and limits of
    the engine that logged them.

    Raises:
        ValueError: fewer steps than features.
    """
    steps = log.steps if steps is None else steps
    shapes = [StepShape.of_record(s.seqs, s.num_decodes) for s in steps]
    e = log.engine
    return LinearCost(
        fit_linear(shapes, [s.period for s in steps]),
        num_kv_blocks=e["num_kv_blocks"],
        block_size=e["block_size"],
        max_model_len=e["max_model_len"],
        vocab_size=e["vocab_size"],
        source=source or f"{e.get('model')}: {len(steps)} logged steps",
    )


def errors_by_kind(cost: LinearCost, steps: list[LoggedStep]) -> dict[str, dict[str, float]]:
    """Per step kind (``decode``, ``mixed``, ``prefill``; ``all``): ``count``, and the
    ``median_abs``, ``p90_abs`` and ``mean`` of ``(predicted - period) / period``
    (NaN where a kind has no step)."""
    groups: dict[str, list[float]] = {k: [] for k in (*STEP_KINDS, "all")}
    for s in steps:
        e = (cost.step_seconds(StepShape.of_record(s.seqs, s.num_decodes)) - s.period) / s.period
        groups[s.kind].append(e)
        groups["all"].append(e)
    out = {}
    for kind, errs in groups.items():
        a = sorted(abs(e) for e in errs)
        out[kind] = {
            "count": len(errs),
            "median_abs": statistics.median(a) if a else math.nan,
            "p90_abs": a[min(len(a) - 1, math.ceil(0.9 * len(a)) - 1)] if a else math.nan,
            "mean": statistics.fmean(errs) if errs else math.nan,
        }
    return out


def holdout(log: StepLog) -> tuple[LinearCost, dict[str, dict[str, float]]]:
    """Fit on the first half of the log's steps; the errors on the second half
    (:func:`errors_by_kind`), within one run, so the host's drift between a calibration
    and a replay is left out.

    Raises:
        ValueError: too few steps.
    """
    half = len(log.steps) // 2
    cost = fit_log(log, log.steps[:half])
    return cost, errors_by_kind(cost, log.steps[half:])
