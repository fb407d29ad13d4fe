"""Calibrate :class:`engine.sim.cost.LinearCost` on this machine: run the real engine, fit.

The sweep keeps ``c`` requests in flight for ``c`` in :data:`CONCURRENCY` (closed loop,
stepped back to back), with prompt lengths log-uniform over ``[8, 1024]`` tokens and
outputs uniform over ``[4, 48]``, so steps mix prefill chunks of every size, decodes of
every context length, and both together. Every step's wall time (``StepRecord.seconds``:
schedule, execute, detokenize) and shape are kept; the fit is over all but a warm-up, and
its error is reported on alternate steps held out of a second fit.
"""

from __future__ import annotations

import math
import platform
import random
import statistics
import time

from engine.config import EngineConfig
from engine.interfaces import StepRecord
from engine.sim.cost import FEATURES, LinearCost, StepShape, fit_linear

CONCURRENCY = (1, 2, 4, 8, 16, 32)
WARMUP_STEPS = 5


def _request(rng: random.Random, vocab: int) -> tuple[list[int], int]:
    n = int(math.exp(rng.uniform(math.log(8), math.log(1024))))
    return [rng.randrange(1000, min(vocab, 40000)) for _ in range(n)], rng.randint(4, 48)


def sweep(config: EngineConfig, steps_per_level: int, seed: int = 0,
          progress=print) -> tuple[list[StepRecord], object]:
    """Run the real engine over the sweep; its step records (warm-up dropped) and engine.

    Raises:
        ModelLoadError: the model cannot be loaded.
    """
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine.from_config(config)
    rng = random.Random(seed)
    records: list[StepRecord] = []
    engine.on_step = records.append
    n = 0
    for level in CONCURRENCY:
        start, t0 = len(records), time.perf_counter()
        while len(records) - start < steps_per_level:
            while len(engine.scheduler.waiting) + len(engine.scheduler.running) < level:
                ids, out = _request(rng, engine.vocab_size)
                engine.add_request(f"cal-{n}", ids, SamplingParams(max_tokens=out,
                                                                   ignore_eos=True))
                n += 1
            engine.step()
        progress(f"  {level:>2} in flight: {len(records) - start} steps, "
                 f"{time.perf_counter() - t0:.1f} s")
    engine.abort([r.request_id for r in list(engine.scheduler.running)
                  + list(engine.scheduler.waiting)])
    return records[WARMUP_STEPS:], engine


def _mape(cost: LinearCost, shapes: list[StepShape], seconds: list[float]) -> float:
    return statistics.fmean(abs(cost.step_seconds(s) - t) / t for s, t in zip(shapes, seconds))


def calibrate(config: EngineConfig, steps_per_level: int = 40, seed: int = 0,
              progress=print) -> tuple[LinearCost, dict]:
    """Fit a :class:`LinearCost` to the sweep; also a summary with the held-out error.

    The hold-out: a fit on even steps, its mean absolute percentage error on odd ones.
    """
    records, engine = sweep(config, steps_per_level, seed, progress)
    shapes = [StepShape.of_record(r.seqs, r.num_decodes) for r in records]
    seconds = [r.seconds for r in records]
    coef = fit_linear(shapes, seconds)
    kw = dict(num_kv_blocks=engine.block_manager.num_blocks, block_size=config.block_size,
              max_model_len=engine.max_model_len, vocab_size=engine.vocab_size)
    half = LinearCost(fit_linear(shapes[::2], seconds[::2]), **kw)
    summary = {
        "steps": len(records),
        "in_sample_mape": _mape(LinearCost(coef, **kw), shapes, seconds),
        "held_out_mape": _mape(half, shapes[1::2], seconds[1::2]),
        "coefficients": dict(zip(FEATURES, coef)),
    }
    source = (f"{engine.model_dir} {config.dtype} on {platform.node()} "
              f"({platform.processor() or platform.machine()}), {len(records)} steps, "
              f"held-out MAPE {summary['held_out_mape']:.1%}")
    return LinearCost(coef, source=source, **kw), summary
