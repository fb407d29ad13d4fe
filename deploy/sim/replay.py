"""Replay a server's step log through the simulator, and compare decision for decision.

``iterserve simulate --replay-steps FILE`` re-runs the logged arrivals (ingress arrival
time, prompt and output tokens, class, priority, ``max_tokens``) through
:class:`deploy.sim.fleet.Fleet`, whose admission, router, scheduler and TPOT guard are the
server's own code. A :class:`ReplayRunner` costs each simulated step what the real step
of the same composition (the same requests, positions and token counts) measured: its
period (start to the next step's start, :attr:`engine.core.step_log.LoggedStep.period`), with
its tokens stamped and its end at the real offsets; a request that woke the idle engine
starts its step after the real delay (:func:`wake_delays`), each request reaches
admission after the real ingress's own delay (:func:`ingress_delays`) and the engine
after the real hand-over from admission (:func:`engine_lags`):
time outside steps, measured per request as steps are. Once the runs part, each step
takes the cost of the next real step not yet used, scaled by a
:class:`engine.core.step_cost.LinearCost` fitted on the same log for the difference between the two
steps' shapes (:class:`ReplayRunner`).

:func:`compare` then matches every request (TTFT, TPOT, admitted or refused) and names the
first step whose composition differs, with the likeliest reason.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from deploy.config import ServiceConfig
from deploy.sim.calibrate import fit_log
from deploy.sim.fleet import Fleet, Outcome, SimRun
from deploy.sim.runner import SimClock, SimRunner
from deploy.sim.trace import SimRequest
from engine.core.interfaces import StepRecord
from engine.core.schedule_output import SchedulerOutput
from engine.core.step_cost import CostModel, StepShape
from engine.core.step_log import IDLE_GAP_S, LoggedStep, StepLog
from engine.model.sampler import SampleResult
from router.admission import POLL_S

Composition = tuple[tuple[str, int, int], ...]

BARS = {"median": 0.02, "p99": 0.05}
"""Decision fidelity's bars: per-request TTFT and TPOT within 2% (median absolute
relative error) and 5% (p99)."""


@dataclass(frozen=True, slots=True)
class RealCost:
    """What one real step cost: its tokens stamped ``tokens_at`` seconds into it, its end
    at ``seconds``, and ``period`` seconds until the next step could start."""

    tokens_at: float
    seconds: float
    period: float

    def scaled(self, k: float) -> RealCost:
        return RealCost(self.tokens_at * k, self.seconds * k, self.period * k)


def ingress_delays(log: StepLog) -> dict[str, float]:
    """Per admitted request: the seconds from its arrival until admission let it in,
    less admission's own hold where that hold was a real wait (at least one re-decision,
    ``router.admission.POLL_S``): the ingress's work on it (reading and tokenizing it,
    waiting for the event loop), which the simulated ingress does not spend."""
    out = {}
    for r in log.requests.values():
        if r.admitted is not None:
            held = r.held_s or 0.0
            out[r.id] = max(0.0, r.admitted - r.arrival - (held if held >= POLL_S else 0.0))
    return out


def engine_lags(log: StepLog) -> dict[str, float]:
    """Per admitted request that ran: the seconds from its admission until the engine had
    it (the dispatch to the replica and its checks, on the ingress's event loop)."""
    return {
        r.id: max(0.0, r.engine_arrival - r.admitted)
        for r in log.requests.values()
        if r.engine_arrival is not None and r.admitted is not None
    }


def wake_delays(log: StepLog) -> dict[str, float]:
    """Per request in the first step after the engine idled: the seconds from when the
    engine had it to the start of that step. The serving loop's idle tick and the
    hand-over to the engine's thread are in it: time outside steps, which requests that
    reach the engine meanwhile join. Whichever of them reaches the simulated engine first
    wakes it, at the real step's start."""
    entered = {
        r.id: next(t for t in (r.engine_arrival, r.admitted, r.arrival) if t is not None)
        for r in log.requests.values()
    }
    seen: set[str] = set()
    out: dict[str, float] = {}
    prev_end = -math.inf
    for s in log.steps:
        if s.start - prev_end >= IDLE_GAP_S:
            for rid, _, _ in s.seqs:
                if rid not in seen and rid in entered and entered[rid] >= prev_end:
                    out[rid] = max(0.0, s.start - entered[rid])
        seen.update(rid for rid, _, _ in s.seqs)
        prev_end = s.start + s.seconds
    return out


@dataclass(frozen=True, slots=True)
class OutsideSteps:
    """A server's typical time outside steps, per request (medians over a log, seconds):
    the ingress's work before admission decides (:func:`ingress_delays`), the hand-over to
    the engine (:func:`engine_lags`), and an idle engine's wake-up (:func:`wake_delays`).
    A simulation of that server's traffic under another plan spends them on every
    request (:meth:`fleet_args`)."""

    ingress_s: float
    engine_lag_s: float
    wake_s: float

    @classmethod
    def of(cls, log: StepLog) -> OutsideSteps:
        """The medians over ``log``'s requests (0 where it has none of a kind)."""

        def med(d: dict[str, float]) -> float:
            return statistics.median(d.values()) if d else 0.0

        return cls(med(ingress_delays(log)), med(engine_lags(log)), med(wake_delays(log)))

    def fleet_args(self, requests: list[SimRequest]) -> dict[str, dict[str, float]]:
        """:class:`deploy.sim.fleet.Fleet`'s ``ingress_s``, ``engine_lag_s`` and
        ``wake_s`` for ``requests``, each the median."""
        return {
            "ingress_s": dict.fromkeys((r.id for r in requests), self.ingress_s),
            "engine_lag_s": dict.fromkeys((r.id for r in requests), self.engine_lag_s),
            "wake_s": dict.fromkeys((r.id for r in requests), self.wake_s),
        }

    def describe(self) -> str:
        return (
            f"time outside steps per request (medians): ingress {1000 * self.ingress_s:.1f} "
            f"ms, hand-over {1000 * self.engine_lag_s:.1f} ms, wake-up {1000 * self.wake_s:.1f} ms"
        )


class ReplayRunner(SimRunner):
    """A simulated runner whose steps cost what the logged real steps cost.

    A simulated step of the same composition as a real one (the same requests,
    positions and token counts) costs what that real step measured, each real step used
    once, in order (``matched``). Once the runs part, a step takes the cost of the first
    real step not yet used, scaled by ``fallback``'s ratio between the two steps' shapes
    (``near``): the real run's own noise, corrected for the small difference the parting
    made. Past the real run's last step, ``fallback`` prices it (``unmatched``).
    """

    def __init__(self, steps: list[LoggedStep], fallback, clock: SimClock):
        super().__init__(fallback, clock)
        self.real = steps
        self.by_composition: dict[Composition, deque[int]] = {}
        for i, s in enumerate(steps):
            self.by_composition.setdefault(s.composition, deque()).append(i)
        self.used = [False] * len(steps)
        self.next = 0
        """The first real step not yet used."""
        self.matched = 0
        self.near = 0
        self.unmatched = 0
        self._tail = 0.0

    def _take(self, i: int) -> LoggedStep:
        self.used[i] = True
        while self.next < len(self.used) and self.used[self.next]:
            self.next += 1
        return self.real[i]

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        key = tuple(sorted((s.request.request_id, s.start, s.num_tokens) for s in out.seqs))
        queue = self.by_composition.get(key)
        while queue and self.used[queue[0]]:
            queue.popleft()
        shape = StepShape.of(out)
        if queue:
            r = self._take(queue.popleft())
            c = RealCost(r.tokens_at, r.seconds, r.period)
            self.matched += 1
        elif self.next < len(self.real):
            r = self._take(self.next)
            predicted = self.cost.step_seconds(StepShape.of_record(r.seqs, r.num_decodes))
            k = self.cost.step_seconds(shape) / predicted if predicted > 0 else 1.0
            c = RealCost(r.tokens_at, r.seconds, r.period).scaled(k)
            self.near += 1
        else:
            seconds = self.cost.step_seconds(shape)
            c = RealCost(seconds, seconds, seconds)
            self.unmatched += 1
        # The engine stamps the tokens at the next reading, and the step ends (its
        # duration, which the engine's step-time model learns from) at the one after.
        self.clock.t += c.tokens_at
        self.clock.advance_after_next_read(c.seconds - c.tokens_at)
        self._tail = c.period - c.seconds
        self.steps += 1
        self.busy_s += c.period
        return self.samples(out)

    def take_tail(self) -> float:
        tail, self._tail = self._tail, 0.0
        return tail


def origin(log: StepLog) -> float:
    """The replay's time 0 on the log's clock: the first arrival or step."""
    times = [r.arrival for r in log.requests.values()] + [s.start for s in log.steps[:1]]
    if not times:
        raise ValueError("the step log holds no request and no step")
    return min(times)


def requests(log: StepLog, t0: float) -> list[SimRequest]:
    """The logged requests as the simulator's, arrivals in seconds from ``t0``.

    A finished request generates what it generated; a refused or unfinished one what
    it asked for (``max_tokens``). ``n > 1`` requests replay as one sequence.
    """
    out = []
    for r in log.requests.values():
        asked = r.max_tokens if r.max_tokens is not None else (r.output_tokens or 1)
        made = r.output_tokens if r.finish is not None and r.output_tokens else asked
        out.append(
            SimRequest(
                r.id,
                r.arrival - t0,
                max(1, r.prompt_tokens),
                max(1, made),
                r.traffic_class,
                priority=r.priority,
                max_tokens=max(1, asked),
            )
        )
    return out


def cancels(log: StepLog, t0: float) -> dict[str, float]:
    """When each aborted request's client left (its ``finish`` with reason ``abort``), in
    seconds from ``t0``: a replay aborts it then too."""
    return {
        r.id: r.finish - t0
        for r in log.requests.values()
        if r.finish_reason == "abort" and r.finish is not None
    }


def service_config(log: StepLog, overrides: dict[str, Any] | None = None) -> ServiceConfig:
    """The service the log was recorded under (its header's ``service``, else its
    engine config with defaults around it), with ``overrides`` (top-level fields;
    ``engine`` merged key by key).

    Raises:
        pydantic.ValidationError: a bad value.
    """
    data = dict(log.engine.get("service") or {})
    engine = dict(data.get("engine") or log.engine.get("config") or {})
    engine.pop("model", None)
    for key in ("step_log", "model", "host", "port"):
        data.pop(key, None)
    overrides = dict(overrides or {})
    engine.update(overrides.pop("engine", {}) or {})
    return ServiceConfig(**{**data, **overrides, "engine": engine})


@dataclass(slots=True)
class Replay:
    """A replayed log: the simulated run, its steps, the real costs left unused."""

    run: SimRun
    steps: list[StepRecord]
    runner: ReplayRunner
    t0: float


def replay(
    log: StepLog,
    config: ServiceConfig,
    fallback: CostModel | None = None,
    history: list[LoggedStep] | None = None,
) -> Replay:
    """Replay ``log``'s requests through one simulated replica of ``config`` whose steps
    cost the logged ones (:class:`ReplayRunner`); admission and routing read live loads,
    as the one-process server's ingress does.

    ``history``: the steps the server ran before the log's first (when the log is a window
    of a longer one). The simulated engine's step-time model, which admission and the
    TPOT guard read, learns from them first, as the server's did.

    Raises:
        ValueError: the log has no requests, or ``config.num_replicas`` is not 1.
    """
    if config.num_replicas != 1:
        raise ValueError("a step-for-step replay runs one replica, as the log was recorded")
    fallback = fallback or fit_log(log)
    t0 = origin(log)
    fleet = Fleet(
        config,
        fallback,
        live_loads=True,
        record_steps=True,
        wake_s=wake_delays(log),
        ingress_s=ingress_delays(log),
        engine_lag_s=engine_lags(log),
    )
    engine = fleet.replicas[0].engine
    for s in history or ():
        engine.observe_step(s.num_prefill_tokens, s.num_decodes, s.seconds)
    runner = ReplayRunner(log.steps, fallback, engine.clock)
    runner.num_kv_blocks = engine.runner.num_kv_blocks
    runner.lora = engine.runner.lora
    engine.runner = runner
    reqs = requests(log, t0)
    if not reqs:
        raise ValueError("the step log holds no request to replay")
    run = fleet.run(reqs, cancels(log, t0))
    return Replay(run, fleet.steps[0], runner, t0)


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def compare(log: StepLog, rep: Replay) -> dict[str, Any]:
    """The replay against the log: per-request errors, agreement, first divergence.

    Returns ``{"requests", "both_ok", "status_differs", "ttft" and "tpot": {"median_abs",
    "p99_abs", "mean_real_s", "mean_sim_s"}, "steps": {"real", "simulated", "matched",
    "unmatched"}, "within_bars": {"median", "p99"}, "divergence": None or {...}}``; errors
    are relative, ``(simulated - real) / real``.
    """
    by_id = {o.request.id: o for o in rep.run.outcomes}
    errors: dict[str, list[float]] = {"ttft": [], "tpot": []}
    means: dict[str, list[tuple[float, float]]] = {"ttft": [], "tpot": []}
    differs = []
    for r in log.requests.values():
        o = by_id.get(r.id)
        real_ok = r.refused is None and r.first_token is not None and r.finish_reason != "abort"
        sim_ok = o is not None and o.status == "ok"
        if real_ok != sim_ok:
            differs.append(r.id)
            continue
        if not real_ok or r.finish_reason == "abort":
            continue
        for name, real, sim in (("ttft", r.ttft_s, o.ttft_s), ("tpot", r.tpot_s, o.tpot_s)):
            if real is None or sim is None or real <= 0 or (name == "tpot" and r.finish is None):
                continue
            errors[name].append((sim - real) / real)
            means[name].append((real, sim))
    stats = {}
    for name in errors:
        abs_err = [abs(e) for e in errors[name]]
        pairs = means[name]
        stats[name] = {
            "compared": len(abs_err),
            "median_abs": _quantile(abs_err, 0.5),
            "p99_abs": _quantile(abs_err, 0.99),
            "mean_real_s": sum(p[0] for p in pairs) / len(pairs) if pairs else None,
            "mean_sim_s": sum(p[1] for p in pairs) / len(pairs) if pairs else None,
        }
    within = {
        stat: all(
            stats[m][f"{stat}_abs"] is not None and stats[m][f"{stat}_abs"] <= bar
            for m in ("ttft", "tpot")
        )
        and not differs
        for stat, bar in BARS.items()
    }
    return {
        "requests": len(log.requests),
        "status_differs": differs,
        **stats,
        "steps": {
            "real": len(log.steps),
            "simulated": len(rep.steps),
            "matched": rep.runner.matched,
            "near": rep.runner.near,
            "unmatched": rep.runner.unmatched,
        },
        "within_bars": within,
        "divergence": divergence(log, rep, by_id),
    }


def divergence(log: StepLog, rep: Replay, by_id: dict[str, Outcome]) -> dict[str, Any] | None:
    """The first step whose composition differs between the real run and the replay,
    and why it likely does (None: every step the same)."""
    for i, (real, sim) in enumerate(zip(log.steps, rep.steps)):
        sim_comp = tuple(sorted(sim.seqs))
        if real.composition == sim_comp:
            continue
        return {
            "step": i,
            "real_start_s": real.start - rep.t0,
            "sim_start_s": sim.start,
            "only_real": sorted({s[0] for s in real.seqs} - {s[0] for s in sim.seqs}),
            "only_sim": sorted({s[0] for s in sim.seqs} - {s[0] for s in real.seqs}),
            "why": _why(log, rep, real, sim, by_id),
        }
    if len(log.steps) != len(rep.steps):
        n = min(len(log.steps), len(rep.steps))
        return {
            "step": n,
            "why": f"the real run ran {len(log.steps)} steps, the replay {len(rep.steps)}",
        }
    return None


def _why(
    log: StepLog, rep: Replay, real: LoggedStep, sim: StepRecord, by_id: dict[str, Outcome]
) -> str:
    start = real.start - rep.t0
    real_ids = {s[0] for s in real.seqs}
    sim_ids = {s[0] for s in sim.seqs}
    for rid in sorted(real_ids ^ sim_ids):
        r, o = log.requests.get(rid), by_id.get(rid)
        if r is None or o is None:
            continue
        entered = (r.admitted if r.admitted is not None else r.arrival) - rep.t0
        if o.status == "refused" or r.refused is not None:
            held = (r.held_s or 0.0) >= POLL_S or "held" in r.reason
            cause = (
                ": admission held it and re-decided it every 50 ms on the ingress's event "
                "loop, whose re-decisions run late by what the loop is busy with; the "
                "simulated ones keep to the 50 ms grid"
                if held
                else ""
            )
            return (
                f"admission: {rid} was {'refused' if r.refused is not None else 'admitted'} "
                f"in the real run and {o.status} in the replay{cause}"
            )
        if o.routed_s is None:
            continue
        if rid in real_ids and o.routed_s > sim.start:
            held = o.routed_s - o.request.arrival_s
            cause = (
                "the ingress's 50 ms re-decision held it"
                if held > 0
                else "the real step started later (time outside steps)"
            )
            return (
                f"{rid} entered the real engine at {entered:.4f} s, before the real step at "
                f"{start:.4f} s, and the simulated one at {o.routed_s:.4f} s, after the "
                f"simulated step at {sim.start:.4f} s: {cause}"
            )
        if rid in sim_ids and entered > start:
            return (
                f"{rid} entered the simulated engine at {o.routed_s:.4f} s, before its step at "
                f"{sim.start:.4f} s; the real ingress admitted it at {entered:.4f} s, after "
                f"the real step began at {start:.4f} s (time outside steps: the steps "
                f"drifted {sim.start - start:+.4f} s apart)"
            )
    for rid in sorted(real_ids ^ sim_ids):
        r, o = log.requests.get(rid), by_id.get(rid)
        if r is None or o is None or r.admitted is None or o.routed_s is None:
            continue
        if (r.held_s or 0.0) >= POLL_S and abs(o.routed_s - (r.admitted - rep.t0)) > 0.001:
            return (
                f"{rid} was held by admission and let in at {r.admitted - rep.t0:.4f} s in "
                f"the real run, at {o.routed_s:.4f} s in the replay: the ingress's 50 ms "
                "re-decisions run late by what its event loop is busy with, the simulated "
                "ones keep to the 50 ms grid, so held requests reach the queue in another "
                "order or step"
            )
    diff = sorted(set(real.seqs) ^ {tuple(x) for x in sim.seqs})
    return (
        f"the scheduler chose differently at {start:.4f} s: real "
        f"{sorted(set(real.seqs) - set(sim.seqs))}, simulated "
        f"{sorted(set(sim.seqs) - set(real.seqs))} (the guard's prefill caps: real "
        f"{real.cap} / {real.owed}, simulated {sim.prefill_cap} / {sim.owed_cap})"
        if diff
        else f"the scheduler chose differently at {start:.4f} s"
    )
