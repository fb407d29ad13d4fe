"""The autoscaling policy: a target replica count from what each traffic class feels.

Pure Python, no torch and no Ray. Ray Serve calls it through
:class:`deploy.autoscale.ServePolicy`; the simulator (``iterserve simulate --autoscale``)
calls it in virtual time with the same inputs.

How it decides, once per ``decision_period_s``:

* **Demand.** The work that arrived over the last ``window_s`` seconds, priced with the
  replicas' step-time model (``seconds = a + b * prefill_tokens + c * decode_seqs``,
  :mod:`policies.step_time`): a request of ``P`` prompt and ``O`` output tokens adds
  ``b * P + c * O`` seconds of step time wherever it runs. A replica can spend at most
  ``1 - a / T`` of each second on such work while its steps stay within ``T``, the
  tightest TPOT target of the classes it serves (the fixed part ``a`` is paid every
  step). Requests refused or held by admission count: they are demand the fleet did not
  serve. Dividing by ``target_utilization`` of that capacity leaves headroom for bursts
  and for the model's error. The result is the replicas the demand needs, a fraction.
* **Risk.** A class is at risk when its attainment over the window is under
  ``target_attainment``, when admission refused some of its requests, or when a request
  of it has been held past half its ``max_queue_wait_s``; the fleet is at risk when the
  replicas' KV cache is nearly full or their measured steps outrun the TPOT target.
* **Up** on the demand, to the replicas it needs (several at a time), once its evidence
  lasts: the counts cover a whole ``window_s``, some replica's step-time fit is warm
  (:attr:`policies.step_time.StepTimeModel.warm`), and the demand has asked for more
  replicas at every decision for ``upscale_delay_s``. A start on less holds, for
  ``scale_down_delay_s``, a replica that a passing reading asked for: a first window a
  moment long, a fit on a new replica's first steps. Ray Serve's default policy waits its
  ``upscale_delay_s`` for the same reason.
* **Up** by one at once when a class is at risk and the demand model says the fleet
  suffices, or has not asked for long enough: the risk is harm seen now. Not for a burst
  shorter than a replica's start: when the demand fits the fleet and the backlog it
  holds drains within ``replica_start_s``, a new replica would come too late.
* **Down** only after the demand has fitted in fewer replicas, at
  ``scale_down_utilization`` of the target, with no class at risk, for
  ``scale_down_delay_s`` seconds on end, and no sooner than that after the last scale-up
  (hysteresis and cooldown, so the fleet does not flap).
* **Shares.** A class whose ``scale_share`` is under 1 (batch, by default) may wait: its
  demand alone scales the fleet to at most that share of ``max_replicas``.

Where the rules come from: the demand model is Sarathi-Serve's budgeted step (Agrawal et
al., OSDI 2024) priced by the replicas' own fit; scaling on SLO attainment and queue wait
rather than on requests in flight answers the gaps that users report of request-count
autoscalers (Ray Serve's default) and of planners that ignore queue wait.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.priority import TrafficClass
from policies.step_time import DEFAULT_STEP_COEFFICIENTS

KV_RISK_USAGE = 0.95
"""Mean KV usage of the replicas above which the fleet is at risk (preemptions follow)."""

MIN_MISSES = 2
"""Requests a class must miss in the window, beyond what ``target_attainment`` allows,
before it is at risk: one late or refused request says little about the fleet."""

HELD_RISK_FRACTION = 0.5
"""A request held past this fraction of its class's ``max_queue_wait_s`` puts the class
at risk: admission refuses it when the wait runs out."""


@dataclass(frozen=True, slots=True)
class ClassLoad:
    """One traffic class over the policy's window (:class:`policies.scaling_window.ClassWindow`
    counts these from the ingress's events)."""

    arrived: int = 0
    """Requests that arrived in the window: admitted, held or refused."""
    prompt_tokens: int = 0
    """Their prompt tokens, summed."""
    output_tokens: float = 0.0
    """Output tokens per request: the mean of the window's finished requests, else what
    they asked for (``max_tokens``); 0 when unknown."""
    finished: int = 0
    """Requests that finished in the window."""
    met: int = 0
    """Of those, the ones within both SLOs of the class (TTFT from arrival at the ingress,
    so time held counts)."""
    refused: int = 0
    """Requests admission refused (429) in the window."""
    held: int = 0
    """Requests admission holds now."""
    oldest_held_s: float = 0.0
    """Seconds the longest-held of them has waited."""

    @property
    def attainment(self) -> float | None:
        """Finished requests within SLO over those finished; refusals count as misses.
        None: nothing finished or refused in the window."""
        n = self.finished + self.refused
        return None if n == 0 else self.met / n


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One serving replica, from its load snapshot (:class:`policies.LoadSnapshot`)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of its KV cache in use, 0..1."""
    step_s: float = 0.0
    """Mean wall seconds of its last steps; 0 when idle."""
    waiting_prefill_tokens: int = 0
    """Prompt tokens it still has to compute."""
    step_coefficients: tuple[float, float, float] = DEFAULT_STEP_COEFFICIENTS
    """Its step-time fit ``(a s, b s/prefill token, c s/decode sequence)``."""
    step_fit_warm: bool = False
    """Its fit's window of steps is full (:attr:`policies.step_time.StepTimeModel.warm`);
    until some replica's is, the demand does not scale the fleet up."""


@dataclass(frozen=True, slots=True)
class FleetState:
    """What the policy reads at one decision."""

    now_s: float
    """Seconds on any clock that only moves forward (wall or virtual)."""
    running: int
    """Replicas serving now."""
    target: int
    """Replicas asked for now (running plus starting; fewer while some drain)."""
    classes: Mapping[str, ClassLoad] = field(default_factory=dict)
    replicas: Sequence[ReplicaLoad] = ()
    window_s: float = 30.0
    """Seconds the class counts cover (shorter than the setting just after start)."""


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """The policy's answer: ``target`` replicas and why, in words a person reads."""

    target: int
    reason: str
    demand_replicas: float
    """Replicas the window's demand needs at the target utilization (a fraction)."""
    at_risk: tuple[str, ...] = ()
    """What is at risk: class names, and ``kv`` or ``step`` for the fleet."""


class AutoscalingSettings(BaseModel):
    """The policy's settings: the one declaration of their names, defaults, bounds and
    meanings. ``deploy.config.AutoscalingConfig``, the ``autoscaling:`` section a user
    writes, derives from it, and the configuration reference and the Helm chart's values
    schema follow from that.

    Raises (at construction):
        pydantic.ValidationError (a ValueError): an unknown name or a value out of range
            (the message names it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1, description="replicas at least (and at start)")
    max_replicas: int = Field(1, ge=1, description="replicas at most")
    decision_period_s: float = Field(
        5.0, gt=0, description="seconds between the policy's decisions"
    )
    window_s: float = Field(
        30.0,
        gt=0,
        description="seconds of traffic (arrivals, refusals, finishes) each decision reads",
    )
    target_attainment: float = Field(
        0.99,
        gt=0,
        le=1,
        description="a class whose share of requests within SLO over the window falls "
        "below this is at risk, and the fleet grows",
    )
    target_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="the share of each replica's capacity (step time within the tightest "
        "TPOT SLO) that the predicted demand may fill",
    )
    scale_down_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="hysteresis: the fleet shrinks only when the demand fits fewer replicas "
        "at this fraction of target_utilization",
    )
    scale_down_delay_s: float = Field(
        120.0,
        ge=0,
        description="seconds the demand must fit fewer replicas, and seconds since the last "
        "scale-up, before the fleet shrinks (cooldown)",
    )
    upscale_delay_s: float = Field(
        30.0,
        ge=0,
        description="seconds the demand must ask for more replicas, at every decision, "
        "before they start (Ray Serve's upscale_delay_s); they start only once the counts "
        "cover window_s and a replica's step-time fit is warm (its window of steps full). "
        "A class at risk (SLO misses, refusals, long holds) adds a replica at once",
    )
    replica_start_s: float = Field(
        20.0,
        ge=0,
        description="seconds a new replica takes to serve (start and model load); a backlog "
        "the fleet drains sooner than this is a burst and does not scale it",
    )

    @model_validator(mode="after")
    def _bounds(self) -> Self:
        # JSON Schema cannot compare two fields, so the Helm chart's template repeats these
        # two rules (helm/iterserve/templates/_helpers.tpl). max_replicas is None only in
        # deploy.config.AutoscalingConfig, until it is resolved against the host.
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(
                f"autoscaling.max_replicas={self.max_replicas} < min_replicas={self.min_replicas}"
            )
        if self.window_s < self.decision_period_s:
            raise ValueError("autoscaling.window_s must be >= decision_period_s")
        return self


class SloAutoscaler:
    """Target replicas from per-class attainment, refusals, time held and predicted demand.

    Args:
        settings: bounds and the policy's own settings.
        classes: the service's traffic classes by name (SLOs, ``scale_share``,
            ``max_queue_wait_s``); a class in a :class:`FleetState` but not here counts
            with the defaults of an unshared class.

    Keeps three times between calls (the last scale-up, since when the demand has asked
    for more replicas, and since when it has fit fewer), so one instance serves one
    deployment.
    """

    def __init__(self, settings: AutoscalingSettings, classes: Mapping[str, TrafficClass]) -> None:
        self.settings = settings
        self.classes = dict(classes)
        self._last_up_s: float | None = None
        self._wanting_since: float | None = None
        self._surplus_since: float | None = None

    # -- the demand model ------------------------------------------------------------------

    def _coefficients(self, state: FleetState) -> tuple[float, float, float]:
        """The median of the replicas' fits (the warm ones', where any is: a new replica's
        first steps would skew it), the prior for a coefficient that is 0 (a fit over
        steps that never vary it, all the same decode count say, cannot identify it, and
        its non-negativity bound leaves it at 0); the prior when none published."""
        fits = [r.step_coefficients for r in state.replicas if r.step_fit_warm] or [
            r.step_coefficients for r in state.replicas
        ]
        if not fits:
            return DEFAULT_STEP_COEFFICIENTS
        med = [statistics.median(f[i] for f in fits) for i in range(3)]
        return tuple(m if m > 0 else p for m, p in zip(med, DEFAULT_STEP_COEFFICIENTS))  # type: ignore[return-value]

    def _step_target_s(self, state: FleetState) -> float:
        """The tightest TPOT SLO of the classes with traffic in the window."""
        slos = [
            self.classes[name].tpot_slo_s
            for name, load in state.classes.items()
            if name in self.classes and (load.arrived or load.held)
        ]
        return (
            min(slos) if slos else min((c.tpot_slo_s for c in self.classes.values()), default=1.0)
        )

    def _replicas_for(self, state: FleetState, work_per_s: float, utilization: float) -> float:
        """Replicas that serve ``work_per_s`` seconds of marginal step time per second at
        ``utilization`` of each one's capacity."""
        a, _, _ = self._coefficients(state)
        capacity = max(0.05, 1.0 - a / self._step_target_s(state))
        return work_per_s / (capacity * utilization)

    def _work_per_s(self, state: FleetState, load: ClassLoad) -> float:
        """Seconds of marginal step time per second that the class's arrivals bring."""
        _, b, c = self._coefficients(state)
        if state.window_s <= 0:
            return 0.0
        tokens = b * load.prompt_tokens + c * load.output_tokens * load.arrived
        return tokens / state.window_s

    def demand_replicas(self, state: FleetState, utilization: float) -> tuple[float, str]:
        """Replicas the window's demand needs at ``utilization``, with each class whose
        ``scale_share`` is under 1 allowed to raise the fleet only to that share of
        ``max_replicas``; and the class whose share capped it ("" if none)."""
        work = {n: self._work_per_s(state, c) for n, c in state.classes.items()}
        need = self._replicas_for(state, sum(work.values()), utilization)
        capped_by = ""
        for name, w in sorted(work.items()):
            share = self.classes[name].scale_share if name in self.classes else 1.0
            if share >= 1.0 or w <= 0:
                continue
            without = self._replicas_for(state, sum(work.values()) - w, utilization)
            ceiling = max(without, share * self.settings.max_replicas)
            if need > ceiling:
                need, capped_by = ceiling, name
        return need, capped_by

    # -- risk -------------------------------------------------------------------------------

    def _risks(self, state: FleetState) -> list[tuple[str, str]]:
        """``(who, words)`` for each thing at risk now: ``who`` is a class name, or ``""``
        for the fleet (KV cache, step time); e.g. ``("interactive", "interactive attainment
        93% < 99%")``."""
        out = []
        s = self.settings
        for name, load in sorted(state.classes.items()):
            cls = self.classes.get(name)
            att = load.attainment
            parts = []
            judged = load.finished + load.refused
            misses = judged - load.met
            if att is not None and misses >= (1 - s.target_attainment) * judged + MIN_MISSES:
                parts.append(f"attainment {att:.1%} < {s.target_attainment:.0%}")
                if load.refused:
                    parts.append(f"{load.refused} refused")
            wait = cls.max_queue_wait_s if cls is not None else 0.0
            if load.held and wait > 0 and load.oldest_held_s > HELD_RISK_FRACTION * wait:
                parts.append(f"{load.held} held up to {load.oldest_held_s:.1f} s")
            if parts:
                out.append((name, f"{name} " + " and ".join(parts)))
        if state.replicas:
            kv = statistics.fmean(r.kv_usage for r in state.replicas)
            if kv > KV_RISK_USAGE:
                out.append(("", f"KV cache {kv:.0%} full"))
            busy = [r.step_s for r in state.replicas if r.step_s > 0]
            target = self._step_target_s(state)
            if busy and statistics.fmean(busy) > target:
                out.append(("", f"steps {statistics.fmean(busy):.2f} s > TPOT {target:.2f} s"))
        return out

    def _may_grow_for(self, who: str, current: int) -> bool:
        """Whether a risk to ``who`` may add a replica to ``current``: a class that may
        wait (``scale_share`` under 1) only below its share of ``max_replicas``."""
        cls = self.classes.get(who)
        if cls is None or cls.scale_share >= 1.0:
            return True
        return current < cls.scale_share * self.settings.max_replicas

    def _backlog_drains_s(self, state: FleetState) -> float | None:
        """Seconds the running replicas need to compute the prompts they and admission hold,
        at the capacity the demand leaves them (inf: none left; None: nothing is held, so
        a risk is not a burst's)."""
        _, b, _ = self._coefficients(state)
        held_tokens = sum(r.waiting_prefill_tokens for r in state.replicas)
        held_tokens += sum(
            load.held * load.prompt_tokens / max(1, load.arrived) for load in state.classes.values()
        )
        need, _ = self.demand_replicas(state, 1.0)
        spare = max(0, state.running) - need
        if held_tokens <= 0:
            return None
        if spare <= 0:
            return math.inf
        a, _, _ = self._coefficients(state)
        capacity = max(0.05, 1.0 - a / self._step_target_s(state))
        return b * held_tokens / (spare * capacity)

    # -- the decision -----------------------------------------------------------------------

    def decide(self, state: FleetState) -> ScalingDecision:
        """The target replica count for ``state``, within ``[min_replicas, max_replicas]``.

        Raises:
            ValueError: ``state.running`` or ``state.target`` is negative.
        """
        if state.running < 0 or state.target < 0:
            raise ValueError(f"running={state.running}, target={state.target}: must be >= 0")
        s = self.settings
        current = max(state.target, s.min_replicas)
        need, capped_by = self.demand_replicas(state, s.target_utilization)
        risks = self._risks(state)
        words = [w for _, w in risks]
        cap = (
            f" ({capped_by} capped at {self.classes[capped_by].scale_share:.0%} of max)"
            if capped_by
            else ""
        )
        demand_words = f"demand needs {need:.2f} replicas{cap}"
        wanted = math.ceil(need - 1e-9)
        if wanted <= current or current >= s.max_replicas:
            self._wanting_since = None
        else:
            wait = self._demand_wait(state)
            if wait:
                demand_words += f" ({wait})"
                wanted = current
        growing = [w for who, w in risks if self._may_grow_for(who, current)]
        starting = state.target - state.running
        if growing and wanted <= current:
            if starting > 0:
                # The replicas on their way are the answer to this risk: wait for them.
                self._surplus_since = None
                return self._keep(
                    current,
                    f"{'; '.join(words)}; {starting} starting: hold at {current}",
                    need,
                    words,
                )
            drains = self._backlog_drains_s(state)
            if drains is not None and drains <= s.replica_start_s:
                # A burst: the fleet clears it before a new replica would serve.
                self._surplus_since = None
                return self._keep(
                    current,
                    f"{'; '.join(words)}, but the backlog drains within a replica's start "
                    f"({s.replica_start_s:.0f} s): hold at {current}",
                    need,
                    words,
                )
            wanted = current + 1
        if wanted > current:
            target = min(wanted, s.max_replicas)
            self._surplus_since = None
            if target == current:
                why = "; ".join(growing + [demand_words])
                return self._keep(current, f"{why}; at max_replicas", need, words)
            self._last_up_s = state.now_s
            self._wanting_since = None
            why = "; ".join(growing + [demand_words])
            return ScalingDecision(target, f"{why}: +{target - current}", need, tuple(words))
        # Scale down: the demand must fit fewer replicas with margin, for a while.
        down_need, _ = self.demand_replicas(state, s.target_utilization * s.scale_down_utilization)
        fewer = max(s.min_replicas, math.ceil(down_need - 1e-9))
        if risks or fewer >= current or starting > 0:
            # Not while replicas start either: they were asked for minutes ago at most, and
            # stopping one mid-start wastes its start.
            self._surplus_since = None
            return self._keep(current, f"{demand_words}: hold at {current}", need, words)
        if self._surplus_since is None:
            self._surplus_since = state.now_s
        since = state.now_s - self._surplus_since
        cooled = self._last_up_s is None or state.now_s - self._last_up_s >= s.scale_down_delay_s
        if since < s.scale_down_delay_s or not cooled:
            return self._keep(
                current,
                f"{demand_words}: {fewer} would do for {since:.0f} s of "
                f"{s.scale_down_delay_s:.0f} s; hold at {current}",
                need,
                words,
            )
        self._surplus_since = state.now_s
        return ScalingDecision(
            fewer,
            f"{demand_words}, {fewer} fit for {since:.0f} s: -{current - fewer}",
            need,
        )

    def _demand_wait(self, state: FleetState) -> str:
        """Why the demand, which asks for more replicas now, may not add them yet ("" when
        it may): the counts cover less than ``window_s``, no replica's fit is warm, or it
        has not asked at every decision for ``upscale_delay_s`` (the time it has asked
        since starts with its first ask)."""
        s = self.settings
        if self._wanting_since is None:
            self._wanting_since = state.now_s
        since = state.now_s - self._wanting_since
        if state.window_s < s.window_s - 1e-9:
            return f"window {state.window_s:.0f} s of {s.window_s:.0f} s"
        if not any(r.step_fit_warm for r in state.replicas):
            return "step-time fit cold"
        if since < s.upscale_delay_s:
            return f"for {since:.0f} s of {s.upscale_delay_s:.0f} s"
        return ""

    def _keep(self, current: int, reason: str, need: float, risks: list[str]) -> ScalingDecision:
        return ScalingDecision(current, reason, need, tuple(risks))


__all__ = [
    "AutoscalingSettings",
    "ClassLoad",
    "FleetState",
    "ReplicaLoad",
    "ScalingDecision",
    "SloAutoscaler",
]
