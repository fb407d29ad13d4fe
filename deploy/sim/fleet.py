"""N replicas, the ingress's admission and the router, in virtual time, with the real code.

Each replica is an :class:`engine.LLMEngine` whose runner (:mod:`deploy.sim.runner`)
advances a virtual clock by a cost model (:mod:`engine.core.step_cost`,
:mod:`deploy.sim.roofline`): its scheduler, block manager, policy and TPOT guard are
production's. The ingress side runs :class:`router.admission.IngressAdmission` (held
requests re-decided every ``router.admission.POLL_S``) and
:class:`router.choice.ReplicaChooser` on snapshots each replica publishes every
``routing_stats_period_s``, adjusted by what was routed since
(:class:`router.choice.RoutedSince`), as in Serve.

A request whose ``model`` names a LoRA adapter (:attr:`deploy.sim.trace.SimRequest.model`)
runs with it, under the scheduler's ``max_loras`` rule; each replica's snapshot lists the
adapters it holds (``LoadSnapshot.loras``), which the router prefers, and its prompt's
prefix hashes are salted with the adapter's name, as the ingress's are.

A discrete-event loop orders arrivals, re-decisions, snapshot publications and replica
steps by virtual time. A step runs whole when it starts, so a snapshot published during it
already shows its result (at most one step early); the network and Serve's own hops cost
nothing here.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Protocol

from deploy.config import ServiceConfig
from deploy.sim import ROUTING
from deploy.sim.runner import SimClock, sim_engine
from deploy.sim.trace import SimRequest
from engine import LLMEngine, RequestOutputKind, SamplingParams
from engine.core.interfaces import StepRecord
from engine.core.params import LoRARequest
from policies import Admit, LoadSnapshot, Reject, TrafficClass
from policies.autoscale import (
    AutoscalingSettings,
    FleetState,
    ScalingDecision,
)
from policies.scaling_signals import replica_load
from policies.scaling_window import ClassWindow
from router.admission import POLL_S, IngressAdmission, computed_tokens
from router.choice import ReplicaChooser, RoutedSince
from router.contract import RequestShape
from router.prefix import adapter_salt, cached_tokens, prefix_hashes

IDLE_STEP_S = 0.005
"""Virtual seconds before an engine that scheduled nothing while it has work steps again
(the static policy filling a batch, or every request blocked on KV)."""

_SNAPSHOT, _ARRIVAL, _ENTER, _STEP, _CANCEL, _READY, _DECIDE = range(7)
# (the order of events at one instant)


class Scaler(Protocol):
    """What the fleet asks for a target replica count: :class:`policies.autoscale.
    SloAutoscaler`, or :class:`deploy.sim.autoscale.QueueLengthScaler` (Ray Serve's
    default policy)."""

    def decide(self, state: FleetState) -> ScalingDecision: ...


@dataclass(frozen=True, slots=True)
class Autoscaling:
    """A fleet that scales: who decides, how often, and what a new replica costs."""

    scaler: Scaler
    settings: AutoscalingSettings
    """Bounds, ``decision_period_s`` and ``window_s`` (the scaler's own rules aside)."""
    start_s: float
    """Virtual seconds from a replica being asked for to its first request."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One autoscaling decision that changed the target, as the report lists it."""

    t: float
    target: int
    reason: str


@dataclass(slots=True)
class Outcome:
    """What happened to one request. Times are virtual seconds from the run's start."""

    request: SimRequest
    status: str = "pending"
    """``ok``, ``refused`` (admission's 429), ``rejected`` (too long for a replica), or
    ``aborted`` (its client left first: ``Fleet.run``'s ``cancels``)."""
    replica: int = -1
    routed_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    reason: str = ""
    shape: RequestShape | None = None
    seen: int = -1
    """The fleet's load version at this request's last admission decision."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = self.request.output_tokens
        if self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else 0.0


def meets(o: Outcome, cls: TrafficClass) -> bool:
    """Whether ``o`` finished within both SLOs of ``cls`` (TTFT from its arrival)."""
    return o.status == "ok" and o.ttft_s <= cls.ttft_slo_s and o.tpot_s <= cls.tpot_slo_s


@dataclass(slots=True)
class KvSample:
    """One replica's load when it published a snapshot."""

    t: float
    replica: int
    kv_usage: float
    running: int
    waiting: int


@dataclass(slots=True)
class SimRun:
    outcomes: list[Outcome]
    timeline: list[KvSample]
    preemptions: int
    steps: int
    busy_s: list[float]
    """Each replica's virtual seconds spent in steps."""
    end_s: float
    replica_s: float = 0.0
    """Virtual seconds of replicas held (asked for until stopped), summed."""
    decisions: list[Decision] = field(default_factory=list)
    """Autoscaling decisions that changed the target (none for a fixed fleet)."""


STARTING, SERVING, DRAINING, STOPPED = "starting", "serving", "draining", "stopped"


@dataclass(slots=True)
class _Replica:
    engine: LLMEngine
    state: str = SERVING
    """``starting`` (asked for, not yet serving), ``serving``, ``draining`` (no new
    requests; stops when its last one ends) or ``stopped``."""
    asked_s: float = 0.0
    stopped_s: float | None = None
    snap: LoadSnapshot | None = None
    stepping: bool = False
    live: dict[str, Outcome] = field(default_factory=dict)
    in_flight: LoadSnapshot | None = None
    """``live_loads``: the load as after the step now running, published at its start
    (``LLMEngine.on_scheduled``), as a served engine publishes it."""
    step_start: float = 0.0
    step_end: float = 0.0
    queued: list[tuple[str, int]] = field(default_factory=list)
    """``live_loads``: requests added since the running step started."""


class Fleet:
    """Replays requests through ``config.num_replicas`` simulated replicas.

    Args:
        config: the service as it would be deployed (engine, classes, admission,
            prefix affinity, routing stats period).
        cost: the replicas' step-time model (:mod:`engine.core.step_cost`).
        routing: one of :data:`ROUTING`.
        seed: the router's pair draws; a run is a pure function of its inputs and seed.
        timeline_period_s: how often a replica's KV usage is kept for the report.
        live_loads: admission and routing read each replica's load as it is at the
            decision, as the one-process server's ingress does (``iterserve serve`` with
            one replica), instead of the snapshot published every
            ``routing_stats_period_s``, as on Ray Serve. During a step that is the load
            as after it, with the step's predicted seconds left, plus the requests added
            since it started (``AsyncLLMEngine.load_snapshot``).
        wake_s: per request id, seconds from its engine having it to the first step of
            the idle replica it wakes (a replay's measured time outside steps; default none).
        ingress_s: per request id, seconds from its arrival until admission first
            decides it (a replay's measured ingress time; default none). Its TTFT still
            counts from its arrival.
        engine_lag_s: per request id, seconds from its admission until its engine has
            it (a replay's measured hand-over; until then no load shows it, and the TPOT
            guard's TTFT deadlines count from then; default none).
        record_steps: keep every replica's :class:`engine.core.interfaces.StepRecord` in
            :attr:`steps` (a replay compares them with the real run's).
        autoscaling: scale the fleet in virtual time, starting from
            ``config.num_replicas`` (None: a fixed fleet).

    Raises:
        ValueError: unknown routing.
    """

    def __init__(
        self,
        config: ServiceConfig,
        cost,
        *,
        routing: str = "load-aware",
        seed: int = 0,
        timeline_period_s: float = 1.0,
        live_loads: bool = False,
        record_steps: bool = False,
        wake_s: dict[str, float] | None = None,
        ingress_s: dict[str, float] | None = None,
        engine_lag_s: dict[str, float] | None = None,
        autoscaling: Autoscaling | None = None,
    ) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing {routing!r}: one of {ROUTING}")
        self.config = config
        self.routing = routing
        self.now = 0.0
        self._econfig = config.engine_config()
        self._cost = cost
        self.live_loads = live_loads
        self.wake_s = wake_s or {}
        self.ingress_s = ingress_s or {}
        self.engine_lag_s = engine_lag_s or {}
        self.record_steps = record_steps
        self.replicas: list[_Replica] = []
        self.steps: list[list[StepRecord]] = []
        for _ in range(config.num_replicas):
            self._add_replica(SERVING)
        engines = [r.engine for r in self.replicas]
        econfig = self._econfig
        self.autoscaling = autoscaling
        self.target = config.num_replicas
        self.decisions: list[Decision] = []
        self.window = ClassWindow(autoscaling.settings.window_s) if autoscaling else None
        """The scaler's per-class counts (none kept for a fixed fleet)."""
        classes = config.traffic_classes()
        self._classes = classes
        policy = econfig.make_policy()
        self.admission = IngressAdmission(
            classes, policy=policy, enabled=config.admission, clock=lambda: self.now
        )
        self.chooser = ReplicaChooser(self.admission.controller, random.Random(seed))
        self.routed = RoutedSince()
        self.block_size = econfig.block_size
        self.vocab_size = engines[0].vocab_size
        self.model_name = config.model_name()
        """The base model's name: a request whose ``model`` is it runs without an adapter."""
        self.timeline_period_s = timeline_period_s
        self._events: list = []
        self._order = itertools.count()
        self._held: dict[str, int] = {}
        self._timeline: list[KvSample] = []
        self._pending = 0
        self._version = 0
        """Bumped whenever what admission reads changes: a snapshot, a routing, a held
        request leaving; held requests are re-decided in full only after a change."""
        self.fast_holds = True
        """False: re-decide every held request in full at every poll (tests compare)."""

    def _add_replica(self, state: str) -> int:
        """A new replica (its engine idle) in ``state``; its index."""
        r = _Replica(sim_engine(self._econfig, self._cost, SimClock()), state, self.now)
        if self.live_loads:
            r.engine.on_scheduled = functools.partial(setattr, r, "in_flight")
        kept: list[StepRecord] = []
        if self.record_steps:
            r.engine.add_step_listener(kept.append)
        self.replicas.append(r)
        self.steps.append(kept)
        return len(self.replicas) - 1

    def _serving(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.state == SERVING]

    def run(self, requests: list[SimRequest], cancels: dict[str, float] | None = None) -> SimRun:
        """Replay ``requests`` (sorted by arrival) to the end; every request's outcome.

        ``cancels``: per request id, when its client leaves (virtual seconds); a request
        not finished by then is aborted (held: dropped from admission; running: its KV
        blocks freed before the next step), as a client's disconnect aborts it.
        """
        outcomes = [Outcome(r) for r in requests]
        self._outcomes = {o.request.id: o for o in outcomes}
        for o in outcomes:
            if cancels and o.request.id in cancels:
                self._push(cancels[o.request.id], _CANCEL, o)
        for o in outcomes:
            self._push(o.request.arrival_s + self.ingress_s.get(o.request.id, 0.0), _ARRIVAL, o)
        self._pending = len(outcomes)
        self._publish()  # snapshots at time 0
        self._push(self.config.routing_stats_period_s, _SNAPSHOT, None)
        if self.autoscaling is not None:
            self._push(self.autoscaling.settings.decision_period_s, _DECIDE, None)
        while self._events:
            self.now, kind, _, payload = heapq.heappop(self._events)
            if kind == _STEP:
                self._step(payload)
            elif kind == _ARRIVAL:
                self._decide(payload)
            elif kind == _CANCEL:
                self._cancel(payload)
            elif kind == _ENTER:
                self._enter(*payload)
            elif kind == _READY:
                self._ready(payload)
            elif kind == _DECIDE:
                if self._busy():
                    self._scale()
                    self._push(
                        self.now + self.autoscaling.settings.decision_period_s, _DECIDE, None
                    )
            elif self._busy():
                self._publish()
                self._push(self.now + self.config.routing_stats_period_s, _SNAPSHOT, None)
        return SimRun(
            outcomes,
            self._timeline,
            sum(r.engine.scheduler.num_preemptions for r in self.replicas),
            sum(r.engine.runner.steps for r in self.replicas),
            [r.engine.runner.busy_s for r in self.replicas],
            self.now,
            sum(
                (self.now if r.stopped_s is None else r.stopped_s) - r.asked_s
                for r in self.replicas
            ),
            self.decisions,
        )

    # -- autoscaling --------------------------------------------------------------------------

    def fleet_state(self) -> FleetState:
        """What the scaler reads now: the window's per-class counts (held requests by
        their arrival), and each serving replica's load.

        Raises:
            RuntimeError: the fleet does not scale (no window is kept).
        """
        if self.window is None:
            raise RuntimeError("a fixed fleet keeps no scaling window")
        held: dict[str, list[float]] = {}
        for rid in self._held:
            o = self._outcomes[rid]
            held.setdefault(o.request.traffic_class, []).append(o.request.arrival_s)
        replicas = [replica_load(self.replicas[i].engine.load_snapshot()) for i in self._serving()]
        return FleetState(
            now_s=self.now,
            running=len(replicas),
            target=self.target,
            classes=self.window.loads(self.now, held),
            replicas=replicas,
            window_s=self.window.span_s(self.now),
        )

    def _scale(self) -> None:
        """One decision: start replicas, or stop starting ones first, then drain the least
        loaded serving ones."""
        assert self.autoscaling is not None
        bounds = self.autoscaling.settings
        d = self.autoscaling.scaler.decide(self.fleet_state())
        target = min(max(d.target, bounds.min_replicas), bounds.max_replicas)
        if target == self.target:
            return
        self.decisions.append(Decision(self.now, target, d.reason))
        for _ in range(target - self.target):
            i = self._add_replica(STARTING)
            self._push(self.now + self.autoscaling.start_s, _READY, i)
        surplus = self.target - target
        starting = [i for i, r in enumerate(self.replicas) if r.state == STARTING]
        for i in reversed(starting[-surplus:] if surplus > 0 else []):
            self._stop(i)
            surplus -= 1
        if surplus > 0:
            idle_first = sorted(
                self._serving(),
                key=lambda i: len(self.replicas[i].live),
            )
            for i in idle_first[:surplus]:
                self.replicas[i].state = DRAINING
                self.routed.forget(i)
                self.chooser.prefixes.forget(i)
                if not self.replicas[i].live:
                    self._stop(i)
        self.target = target
        self._version += 1

    def _ready(self, i: int) -> None:
        """Replica ``i`` finished starting (unless it was stopped meanwhile)."""
        r = self.replicas[i]
        if r.state == STARTING:
            r.state = SERVING
            self._publish()
            self._version += 1

    def _stop(self, i: int) -> None:
        r = self.replicas[i]
        r.state, r.stopped_s = STOPPED, self.now

    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self._events, (t, kind, next(self._order), payload))

    def _busy(self) -> bool:
        return self._pending > 0 or any(r.stepping for r in self.replicas)

    def _publish(self) -> None:
        self._version += 1
        keep = self.now // self.timeline_period_s != (
            (self.now - self.config.routing_stats_period_s) // self.timeline_period_s
        )
        for i, r in enumerate(self.replicas):
            if r.state == STOPPED:
                continue
            # The engine has run its current step at once (the fake clock is at its end):
            # its state is as after the step in flight, as a real replica publishes it.
            left = max(0.0, r.engine.clock.t - self.now) if r.stepping else 0.0
            r.snap = dataclasses.replace(
                r.engine.load_snapshot(), timestamp=self.now, step_left_s=left
            )
            if (keep or self.now == 0) and r.state == SERVING:
                self._timeline.append(
                    KvSample(
                        self.now,
                        i,
                        r.snap.kv_usage,
                        r.snap.total_running,
                        sum(r.snap.waiting_requests.values()),
                    )
                )

    def _refresh(self) -> None:
        """Every replica's snapshot as of now (``live_loads``); a new version only where
        one changed."""
        for r in self.replicas:
            if r.state == STOPPED:
                continue
            if r.in_flight is not None and r.step_start <= self.now < r.step_end:
                left = max(0.0, r.in_flight.step_left_s - (self.now - r.step_start))
                snap = dataclasses.replace(
                    r.in_flight.with_queued(r.queued), timestamp=0.0, step_left_s=left
                )
            else:
                snap = dataclasses.replace(r.engine.load_snapshot(), timestamp=0.0, step_left_s=0.0)
            if r.snap is None or dataclasses.replace(r.snap, timestamp=0.0) != snap:
                self._version += 1
            r.snap = dataclasses.replace(snap, timestamp=self.now)

    def _load(self, i: int) -> LoadSnapshot:
        """Replica ``i``'s load for a decision: live, or its last snapshot with what was
        routed to it since."""
        snap = self.replicas[i].snap
        return snap if self.live_loads else self.routed.adjust(i, snap, self.now)

    def _shape(self, req: SimRequest) -> RequestShape:
        cls = self.admission.controller.classes.get(req.traffic_class)
        if cls is None:  # a trace line's own class
            raise ValueError(
                f"request {req.id}: unknown traffic class {req.traffic_class!r} "
                f"(known: {sorted(self.admission.controller.classes)})"
            )
        lora = self.lora(req)
        salt = adapter_salt(lora.name) if lora is not None else 0
        hashes = (
            prefix_hashes(_prompt(req, self.vocab_size), self.block_size, salt=salt)
            if self.config.prefix_affinity
            else ()
        )
        priority = cls.default_priority if req.priority is None else req.priority
        return RequestShape(req.prompt_tokens, req.traffic_class, priority, hashes, lora)

    def lora(self, req: SimRequest) -> LoRARequest | None:
        """The adapter ``req`` runs with (None: the base model), at a placeholder path
        (``sim://NAME``) that nothing reads."""
        if req.model is None or req.model == self.model_name:
            return None
        return LoRARequest(req.model, f"sim://{req.model}")

    def _loads(self, shape: RequestShape) -> list[tuple[LoadSnapshot, int]]:
        matched = self.chooser.prefixes.matched_blocks(shape.prefix_hashes)
        return [
            (
                self._load(i),
                cached_tokens(matched.get(i, 0), r.snap.block_size, shape.prompt_tokens),
            )
            for i, r in ((i, self.replicas[i]) for i in self._serving())
        ]

    def _cancel(self, o: Outcome) -> None:
        """``o``'s client left: abort it wherever it is, unless it is done."""
        rid = o.request.id
        if o.status != "pending":
            return
        o.status = "aborted"
        if o.replica >= 0:
            r = self.replicas[o.replica]
            r.live.pop(rid, None)
            r.engine.abort(rid)
        else:
            self._pending -= 1
            if rid in self._held:
                self.admission.release(self._held.pop(rid))
        self._version += 1

    def _decide(self, o: Outcome) -> None:
        """An arrival, or a held request's re-decision (as ``IngressAdmission.admit``)."""
        if o.status != "pending":
            return  # its client left while it was held
        req = o.request
        if o.shape is None and self.window is not None:
            self.window.arrived(
                req.traffic_class,
                self.now,
                req.prompt_tokens,
                req.output_tokens if req.max_tokens is None else req.max_tokens,
            )
        shape = o.shape = o.shape or self._shape(req)
        if self.live_loads:
            self._refresh()
        if self.admission.enabled:
            if (
                req.id in self._held
                and self.fast_holds
                and o.seen == self._version
                and self._waits_on(o)
            ):
                self._push(self.now + POLL_S, _ARRIVAL, o)
                return
            loads = self._loads(shape)
            computed = computed_tokens(req.prompt_tokens, loads)
            if req.id not in self._held:
                self._held[req.id] = self.admission.hold(req.traffic_class, req.arrival_s, computed)
            elif self.admission.recount(self._held[req.id], computed):
                self._version += 1  # what it counts ahead of later arrivals changed
            o.seen = self._version
            d = self.admission.decide(
                loads,
                req.traffic_class,
                req.prompt_tokens,
                req.output_tokens if req.max_tokens is None else req.max_tokens,
                shape.priority,
                req.arrival_s,
            )
            if not isinstance(d, Admit | Reject):
                self._push(self.now + POLL_S, _ARRIVAL, o)
                return
            self.admission.release(self._held.pop(req.id))
            self._version += 1  # one held ahead of others fewer
            if isinstance(d, Reject):
                o.status, o.reason = "refused", d.reason
                if self.window is not None:
                    self.window.refused(req.traffic_class, self.now)
                self._pending -= 1
                return
        self._route(o, shape)

    def _waits_on(self, o: Outcome) -> bool:
        """Whether a held request, re-decided on the same loads as its last decision (a
        Wait), would get Wait again: time alone only shrinks its TTFT budget, so it is
        not admitted; it is refused once every replica says it waited its class's
        ``max_queue_wait_s`` or is past reach (``AdmissionController._lost``)."""
        req = o.request
        cls = self.admission.controller.classes[req.traffic_class]  # checked in _shape
        waited = self.now - req.arrival_s
        if not cls.rejectable:
            return True
        if waited >= cls.max_queue_wait_s:
            return False
        lost = self.admission.controller._lost
        return not all(
            lost(s, cls, req.prompt_tokens - cached, waited) for s, cached in self._loads(o.shape)
        )

    def _route(self, o: Outcome, shape: RequestShape) -> None:
        i = self._choose(shape)
        req = o.request
        matched = self.chooser.prefixes.matched_blocks(shape.prefix_hashes).get(i, 0)
        self.routed.record(i, self.now, shape, matched)
        self._version += 1
        self.chooser.prefixes.record(shape.prefix_hashes, i)
        o.replica, o.routed_s = i, self.now
        self._pending -= 1
        lag = self.engine_lag_s.get(req.id, 0.0)
        if lag > 0:
            self._push(self.now + lag, _ENTER, (o, i))
        else:
            self._enter(o, i)

    def _enter(self, o: Outcome, i: int) -> None:
        """``o`` reaches replica ``i``'s engine (its client may have left meanwhile)."""
        if o.status != "pending":
            return
        r, req = self.replicas[i], o.request
        params = SamplingParams(
            max_tokens=req.output_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        try:
            r.engine.add_request(
                req.id,
                _prompt(req, self.vocab_size),
                params,
                traffic_class=req.traffic_class,
                arrival_time=self.now,
                lora_request=self.lora(req),
            )
        except ValueError as e:  # RequestRejectedError: too long for any replica
            o.status, o.reason, o.replica = "rejected", str(e), -1
            return
        r.live[req.id] = o
        r.queued.append((req.traffic_class, req.prompt_tokens))
        if not r.stepping:
            r.stepping = True
            clock = r.engine.clock
            clock.t = max(clock.t, self.now + self.wake_s.get(req.id, 0.0))
            self._push(clock.t, _STEP, i)

    def _choose(self, shape: RequestShape) -> int:
        ids = self._serving()
        if self.routing == "queue-length":
            pair = self.chooser.rng.sample(ids, min(2, len(ids)))
            return min(
                pair,
                key=lambda i: (
                    len(self.replicas[i].engine.scheduler.waiting)
                    + len(self.replicas[i].engine.scheduler.running)
                ),
            )
        ranks = self.chooser.choose(
            ids,
            shape,
            self._load,
            key=lambda i: i,
        )
        return ranks[0][0]

    def _step(self, i: int) -> None:
        r = self.replicas[i]
        clock = r.engine.clock
        clock.t = self.now
        r.step_start, r.queued = self.now, []
        for out in r.engine.step():
            if out.finished:
                o = r.live.pop(out.request_id)
                o.status = "ok"
                o.first_token_s, o.finish_s = out.metrics.first_token_time, out.metrics.finish_time
                if self.window is not None:
                    self.window.finished(
                        o.request.traffic_class,
                        self.now,
                        meets(o, self._classes[o.request.traffic_class]),
                        o.request.output_tokens,
                    )
        if r.state == DRAINING and not r.live:
            self._stop(i)
        r.step_end = clock.t
        clock.t += r.engine.runner.take_tail()
        if r.engine.has_unfinished_requests():
            if r.engine.last_step_num_tokens == 0:
                clock.t = self.now + IDLE_STEP_S
            self._push(clock.t, _STEP, i)
        else:
            r.stepping = False


def _prompt(req: SimRequest, vocab_size: int) -> list[int]:
    """Token ids unique to the request in their first block, or to its ``prompt_key``
    (requests with one key share their prompt; the traces have lengths only), built
    without drawing a random number per token."""
    key = req.id if req.prompt_key is None else req.prompt_key
    n = int(key[1:]) if key[1:].isdigit() else int.from_bytes(key.encode()[-8:])
    m = vocab_size - 2
    head = [2 + n % m, 2 + n // m % m, 2 + n // (m * m) % m]
    return (head + [1] * req.prompt_tokens)[: req.prompt_tokens]
