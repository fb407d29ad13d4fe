"""What the simulator's live checks share (:mod:`bench.sim_validate`, :mod:`bench.twin`): one
``iterserve serve`` replica with admission on and the 70% interactive / 30% batch mix, a
window of the conversation trace (lengths / 8) replayed over HTTP with its span on the
server's clock, the probe served at the start and the end, the capacity of one simulated
replica, the statistics a real and a simulated run are compared by, and how far the real
runs' band is widened when a simulation is judged against it."""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.toolkit import loadgen
from bench.toolkit import report as rp
from bench.toolkit.loadgen import LoadRequest
from bench.toolkit.servers import MIX_API_KEY, MODEL_NAME
from bench.toolkit.targets import HttpTarget
from bench.toolkit.workload import TRACE, Lengths, Window, token_ids
from deploy.config import ServiceConfig
from deploy.sim import replay as rpl
from deploy.sim.fleet import Fleet, SimRun
from deploy.sim.report import latency
from deploy.sim.trace import SimRequest

MIX = {"interactive": 0.7, "batch": 0.3}
SLO = (2.0, 0.5)
"""The interactive class's SLOs (TTFT, TPOT seconds): the default class's."""
BAND = {"mean": 0.05, "p99": 0.10}
"""How far the band of the real runs is widened when a simulated mean or p99 is judged."""
WINDOW_START = 3000
"""First trace row of the window."""
CALIBRATION_RPS = 2.0
"""The rate of the calibration run (30 s of the window), whose fit sets the capacity."""
PROBE = [(64, 24), (256, 16), (32, 48), (512, 8)] * 4
"""The probe's (prompt, output) tokens, served 4 at a time: the same requests at the
start and the end of the run."""
STATS = ("ttft_mean", "tpot_mean", "ttft_p99", "tpot_p99")
"""The statistics a simulation is judged by (seconds, :func:`stats`)."""


def mix_target(client: httpx.AsyncClient, url: str) -> HttpTarget:
    """The server at ``url`` as a load-generator target, with the mix's API key (whose
    ceiling is the interactive class)."""
    auth = {"authorization": f"Bearer {MIX_API_KEY}"}
    return HttpTarget(client, url, MODEL_NAME, extra_headers=auth)


def window_requests(rate: float, duration_s: float, seed: int, tag: str) -> list[LoadRequest]:
    """The trace window at ``rate`` req/s for ``duration_s``; ``seed`` picks the prompt
    token ids, so no run hits another's prefix cache (the replay's prompts are unique)."""
    need = round(rate * duration_s) + 2
    win = Window(TRACE, WINDOW_START, need, Lengths(max_output=128), MIX, seed=seed)
    return win.at_rate(rate, duration_s, tag)[0]


def probe_requests(seed: int) -> list[LoadRequest]:
    """The probe (:data:`PROBE`) as batch requests, its token ids drawn from ``seed``."""
    return [
        LoadRequest(f"probe{seed}-{i}", i, "batch", token_ids(seed, i, p), p, o, 0.0)
        for i, (p, o) in enumerate(PROBE)
    ]


async def serve(target: HttpTarget, reqs: list[LoadRequest], cutoff_s: float) -> dict[str, Any]:
    """Send ``reqs`` open loop; the run's span on the monotonic clock (the server's) and
    its requests counted by status."""
    start = time.monotonic()
    run = await loadgen.open_loop(target, reqs, cutoff_s=cutoff_s)
    statuses: dict[str, int] = {}
    for r in run.records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {"start": start, "end": time.monotonic(), "statuses": statuses}


async def closed(target: HttpTarget, reqs: list[LoadRequest], width: int) -> dict[str, Any]:
    """Serve ``reqs`` ``width`` at a time (the probe); the span, as :func:`serve`'s."""
    start = time.monotonic()
    for i in range(0, len(reqs), width):
        await loadgen.open_loop(target, reqs[i : i + width])
    return {"start": start, "end": time.monotonic()}


def sim_requests(reqs: list[LoadRequest]) -> list[SimRequest]:
    """The same requests for the simulator."""
    return [SimRequest(r.id, r.arrival_s, r.prompt_tokens, r.max_tokens, r.cls) for r in reqs]


def capacity(
    cost, config: ServiceConfig, duration_s: float, outside: rpl.OutsideSteps | None = None
) -> float:
    """The highest rate (x1.1 steps from 0.3 req/s) at which one simulated replica with
    admission off meets 90% attainment on the window (req/s): where the loads are put."""
    off = config.model_copy(update={"admission": False})
    rate, best = 0.3, 0.3
    while rate < 50:
        reqs = sim_requests(window_requests(rate, duration_s, 0, "cap"))
        more = outside.fleet_args(reqs) if outside else {}
        run = Fleet(off, cost, live_loads=True, **more).run(reqs)
        classes = off.traffic_classes()
        met = sum(
            o.status == "ok"
            and o.ttft_s <= classes[o.request.traffic_class].ttft_slo_s
            and o.tpot_s <= classes[o.request.traffic_class].tpot_slo_s
            for o in run.outcomes
        )
        if met / len(run.outcomes) < rp.GOODPUT_ATTAINMENT:
            break
        best, rate = rate, rate * 1.1
    return best


def stats(run: SimRun) -> dict[str, Any]:
    """Mean and p99 TTFT and TPOT (s) over finished requests, as the simulator's report
    computes them (:func:`deploy.sim.report.latency`); requests, finished, refused."""
    return {
        "requests": len(run.outcomes),
        "finished": sum(o.status == "ok" for o in run.outcomes),
        "refused": sum(o.status == "refused" for o in run.outcomes),
        **{k.removesuffix("_s"): v for k, v in latency(run.outcomes).items()},
    }
