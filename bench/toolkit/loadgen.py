"""The load generator every benchmark shares: open and closed loops over a small target protocol.

A :class:`Target` sends one request and yields how many output tokens arrived each time
some do; the generator stamps the times itself, so an in-process engine
(:class:`targets.EngineTarget`), an HTTP endpoint (:class:`targets.HttpTarget`) and later
the simulator are measured by the same code with the same definitions (vLLM's: TTFT from
the scheduled arrival to the first token, E2E to the end of the stream).

Every time in a record is seconds from the run's start (``time.perf_counter``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class LoadRequest:
    """One request to send: a prompt (text, or token ids) and a forced output length."""

    id: str
    row: int  # trace row (negative: not from the trace)
    cls: str | None  # traffic class (None: the server's default)
    prompt: str | list[int]
    prompt_tokens: int
    max_tokens: int  # sent with ignore_eos, so it is the expected output length
    arrival_s: float = 0.0  # scheduled send time, seconds from the run's start
    model: str | None = None  # the ``model`` sent (a LoRA adapter's name); None: the target's


class Refused(Exception):
    """The target refused the request (HTTP 429, or admission's Reject in process)."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Target(Protocol):
    """Where requests go. ``stream`` yields the number of new output tokens per arrival.

    It raises :class:`Refused` when the request is refused, any other exception when it
    fails; it may add its own fields to ``rec`` (status code, admission hold, predictions).
    """

    def stream(self, req: LoadRequest, rec: dict[str, Any]) -> AsyncIterator[int]: ...


def new_record(req: LoadRequest) -> dict[str, Any]:
    """The record one request fills: its identity, then what happened (times in s)."""
    return {
        "id": req.id,
        "row": req.row,
        "class": req.cls,
        "arrival_s": req.arrival_s,
        "prompt_tokens": req.prompt_tokens,
        "output_tokens_expected": req.max_tokens,
        "status": "pending",
        "error": None,
        "send_s": None,
        "lag_s": None,
        "first_token_s": None,
        "last_token_s": None,
        "end_s": None,
        "output_tokens": 0,
        "token_s": [],
    }


async def send(target: Target, req: LoadRequest, rec: dict[str, Any], t0: float) -> None:
    """Send ``req`` at ``t0 + req.arrival_s`` (perf_counter s) and fill ``rec``.

    Status ends as ``finished``, ``refused`` or ``error``; a cancelled request is
    ``cut_off`` (its times so far are kept).
    """
    sched = t0 + req.arrival_s
    await asyncio.sleep(max(0.0, sched - time.perf_counter()))
    now = time.perf_counter()
    rec["send_s"], rec["lag_s"] = now - t0, now - sched
    rec["status"] = "running"
    try:
        async for k in target.stream(req, rec):
            if k <= 0:
                continue
            now = time.perf_counter() - t0
            if rec["first_token_s"] is None:
                rec["first_token_s"] = now
            rec["last_token_s"] = now
            rec["output_tokens"] += k
            rec["token_s"].extend([now] * k)
        rec["status"] = "finished"
    except Refused as e:
        rec.update(status="refused", error=e.reason[:300], retry_after_s=e.retry_after_s)
    except asyncio.CancelledError:
        rec["status"] = "cut_off"
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
    finally:
        rec["end_s"] = time.perf_counter() - t0


@dataclass(slots=True)
class OpenLoopRun:
    """What :func:`open_loop` returns: records in request order, and the run's wall times."""

    records: list[dict[str, Any]]
    t0: float  # perf_counter at the run's start
    wall_s: float  # start to the last request's end (or the cut-off)
    cut_off: int


async def open_loop(
    target: Target,
    requests: list[LoadRequest],
    *,
    cutoff_s: float | None = None,
    drain_only: set[str] | None = None,
    arrivals_end_s: float | None = None,
) -> OpenLoopRun:
    """Send every request at its ``arrival_s`` whatever happened to earlier ones.

    Args:
        cutoff_s: requests still running this many seconds after the start are cancelled
            (status ``cut_off``); None waits for all.
        drain_only: classes waited for up to ``cutoff_s``; the others are cancelled once
            those are done, but not before ``arrivals_end_s`` (None: wait for all).
    """
    t0 = time.perf_counter() + 0.05  # a lead, so that the first request is not already late
    recs = [new_record(r) for r in requests]
    tasks = [asyncio.create_task(send(target, r, rec, t0)) for r, rec in zip(requests, recs)]
    waited = [t for t, r in zip(tasks, requests) if drain_only is None or r.cls in drain_only]
    timeout = None if cutoff_s is None else max(0.0, t0 + cutoff_s - time.perf_counter())
    if waited:
        await asyncio.wait(waited, timeout=timeout)
    if drain_only is not None and arrivals_end_s is not None:
        await asyncio.sleep(max(0.0, t0 + arrivals_end_s - time.perf_counter()))
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    ends = [r["end_s"] for r in recs if r["end_s"] is not None]
    return OpenLoopRun(recs, t0, max(ends, default=0.0), len(pending))


@dataclass(slots=True)
class ClosedLoopRun:
    """What :func:`closed_loop` returns (rates per wall second)."""

    completed: int
    partial: float  # completed fraction of the requests cut at the end
    output_tokens: int
    wall_s: float
    ttft_s: list[float]

    @property
    def requests_per_s(self) -> float:
        return (self.completed + self.partial) / self.wall_s


async def closed_loop(
    target: Target, requests: Callable[[int], LoadRequest], *, concurrency: int, duration_s: float
) -> ClosedLoopRun:
    """``concurrency`` clients send ``requests(i)`` back to back for ``duration_s``."""
    counter: Iterator[int] = iter(range(10**9))
    run = ClosedLoopRun(0, 0.0, 0, 0.0, [])
    t0 = time.perf_counter()
    end = t0 + duration_s

    async def client() -> None:
        while time.perf_counter() < end:
            req = requests(next(counter))
            rec = new_record(req)
            try:
                await send(target, req, rec, time.perf_counter())
            finally:
                run.output_tokens += rec["output_tokens"]
                if rec["first_token_s"] is not None:
                    run.ttft_s.append(rec["first_token_s"])
                if rec["status"] == "finished":
                    run.completed += 1
                else:
                    run.partial += rec["output_tokens"] / req.max_tokens

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(duration_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    run.wall_s = time.perf_counter() - t0
    return run
