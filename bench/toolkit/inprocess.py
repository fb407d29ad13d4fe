"""iterserve's engine in this process, for the scheduling experiments: start (warmed up),
stop, check that a run left no request or KV block behind, and log every step (in the
server's step-log format, :mod:`engine.core.step_log`)."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

from bench.toolkit import loadgen
from bench.toolkit.targets import EngineTarget
from bench.toolkit.workload import token_ids
from engine.core.step_log import StepRecorder, engine_info


async def start_engine(
    config: dict[str, Any],
    step_log: Path | None = None,
    *,
    admission: bool = False,
    predict: bool = False,
) -> tuple[EngineTarget, float]:
    """An ``AsyncLLMEngine`` of ``EngineConfig(**config)`` as a target, warmed up.

    Returns the target and the seconds that loading and warm-up took.
    """
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig

    loop = asyncio.get_running_loop()
    t = time.perf_counter()
    aeng = await loop.run_in_executor(None, AsyncLLMEngine.from_config, EngineConfig(**config))
    if step_log is not None:  # the server's step-log format (engine.core.step_log)
        StepRecorder(engine_info(aeng.engine), step_log, history=0).attach(aeng.engine)
    # Kernels, the allocator and the step-time model's first fit.
    warm = EngineTarget(aeng)
    reqs = [
        loadgen.LoadRequest(f"warm-{i}", -1, "interactive", token_ids(12345, i, n), n, m)
        for i, (n, m) in enumerate(((16, 6), (48, 6), (160, 4), (24, 6)))
    ]
    await loadgen.open_loop(warm, reqs)
    return EngineTarget(aeng, admission=admission, predict=predict), time.perf_counter() - t


async def stop_engine(target: EngineTarget) -> None:
    await target.aeng.shutdown()
    gc.collect()


async def wait_idle(target: EngineTarget, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait for aborts to land; report leftovers and the KV block accounting."""
    aeng, eng = target.aeng, target.engine
    bm = eng.block_manager
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            not eng.has_unfinished_requests()
            and bm.num_free_blocks == bm.num_blocks
            and aeng.num_unfinished == 0
        ):
            break
        await asyncio.sleep(0.05)
    check_error = None
    try:
        bm.check()
    except AssertionError as e:
        check_error = f"BlockManager.check failed: {e}"
    return {
        "blocks_free": bm.num_free_blocks,
        "blocks_total": bm.num_blocks,
        "blocks_ok": bm.num_free_blocks == bm.num_blocks and check_error is None,
        "engine_unfinished": eng.has_unfinished_requests(),
        "streams_open": aeng.num_unfinished,
        "check_error": check_error,
        "engine_error": repr(aeng._error) if getattr(aeng, "_error", None) else None,
    }


async def run_open(
    target: EngineTarget, requests: list, **kw
) -> tuple[loadgen.OpenLoopRun, dict[str, Any]]:
    """:func:`loadgen.open_loop` on the engine, with what the run cost and left behind:
    preemptions, other processes' CPU load, and the idle check (``kw``: open_loop's)."""
    from bench.toolkit.cpu_load import cpu_snapshot, foreign_cores

    preempt0 = target.engine.scheduler.num_preemptions
    cpu0 = cpu_snapshot()
    run = await loadgen.open_loop(target, requests, **kw)
    info = {
        "wall_s": run.wall_s,
        "cut_off": run.cut_off,
        "preemptions": target.engine.scheduler.num_preemptions - preempt0,
        "foreign_cores": foreign_cores(cpu0, cpu_snapshot(), run.wall_s),
        **await wait_idle(target),
    }
    return run, info
