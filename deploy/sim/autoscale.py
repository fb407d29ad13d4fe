"""Autoscaling in virtual time: the policies a fleet can scale by, and a daily load curve.

``iterserve simulate --autoscale`` runs :class:`policies.autoscale.SloAutoscaler` (the
policy that Ray Serve runs live) in :class:`deploy.sim.fleet.Fleet`, replicas starting
``--replica-start-s`` after they are asked for. :class:`QueueLengthScaler` is Ray Serve's
default policy, run from Ray's own functions, so the two compare on the same traffic.
:func:`diurnal_requests` builds the daily curve that ``python -m bench.autoscale`` compares
them on.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deploy.config import ServiceConfig
from deploy.sim.fleet import Autoscaling
from deploy.sim.trace import SimRequest, TraceSpec, load_requests
from policies.autoscale import AutoscalingSettings, FleetState, ScalingDecision, SloAutoscaler

AUTOSCALE_MAX_REPLICAS = 8
"""``--autoscale``'s upper bound where neither the config nor ``--max-replicas`` sets one
(the config's default, this host's CPUs, says nothing of the simulated fleet)."""


class QueueLengthScaler:
    """Ray Serve's default autoscaling policy, on the fleet's replicas.

    Ray's ``replica_queue_length_autoscaling_policy`` wants ``ongoing / target_ongoing``
    replicas, ``ongoing`` being the requests at the replicas (running and queued there,
    averaged over ``look_back_period_s``); Ray's delay logic then applies a change only
    after it has been wanted for ``upscale_delay_s`` (up) or ``downscale_delay_s`` (down).
    Both are Ray's own functions (``ray.serve.autoscaling_policy``), called with the
    virtual clock. Requests that the ingress's admission holds are not at a replica, so
    this policy does not see them, as on Ray Serve.

    Args:
        settings: bounds (its other fields are this module's caller's, not Ray's).
        target_ongoing_requests: Ray's ``target_ongoing_requests`` per replica.
        upscale_delay_s, downscale_delay_s, look_back_period_s: Ray's defaults.
    """

    def __init__(
        self,
        settings: AutoscalingSettings,
        target_ongoing_requests: float,
        upscale_delay_s: float = 30.0,
        downscale_delay_s: float = 600.0,
        look_back_period_s: float = 30.0,
    ) -> None:
        from ray.serve.config import AutoscalingConfig

        self.config = AutoscalingConfig(
            min_replicas=settings.min_replicas,
            max_replicas=settings.max_replicas,
            target_ongoing_requests=target_ongoing_requests,
            upscale_delay_s=upscale_delay_s,
            downscale_delay_s=downscale_delay_s,
            look_back_period_s=look_back_period_s,
        )
        self._samples: deque[tuple[float, float]] = deque()
        self._state: dict = {}

    def decide(self, state: FleetState) -> ScalingDecision:
        from ray.serve.autoscaling_policy import (
            _apply_delay_logic,
            _apply_scaling_factors,
            replica_queue_length_autoscaling_policy,
        )
        from ray.serve.config import AutoscalingContext

        ongoing = sum(r.running + r.waiting for r in state.replicas)
        self._samples.append((state.now_s, ongoing))
        while self._samples[0][0] < state.now_s - self.config.look_back_period_s:
            self._samples.popleft()
        mean = sum(n for _, n in self._samples) / len(self._samples)
        ctx = AutoscalingContext(
            deployment_id=None,
            deployment_name="ModelReplica",
            app_name=None,
            current_num_replicas=state.running,
            target_num_replicas=state.target,
            running_replicas=[],
            total_num_requests=mean,
            total_queued_requests=0.0,
            aggregated_metrics=None,
            raw_metrics=None,
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=self._state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=state.now_s,
            config=self.config,
        )
        desired, _ = replica_queue_length_autoscaling_policy(ctx)
        desired = _apply_scaling_factors(desired, state.running, self.config)
        target, self._state = _apply_delay_logic(
            max(0, desired), state.target, self.config, self._state, _now=state.now_s
        )
        target = min(max(target, self.config.min_replicas), self.config.max_replicas)
        reason = (
            f"{mean:.1f} ongoing / {self.config.target_ongoing_requests:g} per replica "
            f"wants {desired}"
        )
        return ScalingDecision(target, reason, float(desired))


@dataclass(frozen=True, slots=True)
class Diurnal:
    """A day's arrival-rate envelope: ``peak_rps * (1/ratio + (1 - 1/ratio) * s(t))``
    with ``s(t) = ((1 - cos(2 pi t / day_s)) / 2) ** 2``: the trough at ``t = 0``, the peak at
    mid-day, peak/trough = ``ratio``. Squaring the raised cosine narrows the busy hours
    (a plain raised cosine spends as long near the peak as near the trough); the mean rate
    is ``peak * (1/ratio + (1 - 1/ratio) * 3/8)``."""

    day_s: float
    peak_rps: float
    ratio: float = 3.0

    def rate(self, t: float) -> float:
        s = ((1 - math.cos(2 * math.pi * t / self.day_s)) / 2) ** 2
        return self.peak_rps * (1 / self.ratio + (1 - 1 / self.ratio) * s)

    def mean_rate(self) -> float:
        return self.peak_rps * (1 / self.ratio + (1 - 1 / self.ratio) * 3 / 8)


def diurnal_requests(spec: TraceSpec, curve: Diurnal, seed: int = 0) -> list[SimRequest]:
    """The trace of ``spec`` tiled over ``curve.day_s`` at the peak rate, then thinned to
    the curve (each arrival at ``t`` kept with probability ``rate(t) / peak``: Lewis and
    Shedler's thinning of a non-homogeneous Poisson process, here applied to the trace's
    own arrivals so its bursts and lengths stay).

    ``spec.rate_scale`` is ignored: the tiling plays the trace at ``curve.peak_rps``.

    Raises:
        ValueError: as :func:`deploy.sim.trace.load_requests`.
    """
    base = load_requests(spec)
    span = base[-1].arrival_s + (base[-1].arrival_s / max(1, len(base) - 1))
    stretch = (len(base) / span) / curve.peak_rps  # played seconds per trace second
    period = span * stretch
    rng = random.Random(seed)
    out = []
    for copy in range(math.ceil(curve.day_s / period)):
        for r in base:
            t = copy * period + r.arrival_s * stretch
            if t >= curve.day_s:
                break
            if rng.random() * curve.peak_rps <= curve.rate(t):
                out.append(
                    SimRequest(
                        f"c{copy}{r.id}",
                        t,
                        r.prompt_tokens,
                        r.output_tokens,
                        r.traffic_class,
                        r.priority,
                        r.max_tokens,
                    )
                )
    return out


def autoscaling_for(
    config: ServiceConfig, max_replicas: int | None, start_s: float | None
) -> tuple[ServiceConfig, Callable[[], Autoscaling]]:
    """``iterserve simulate --autoscale``'s fleet: ``config`` with an autoscaling section
    (its own, else the defaults) whose ``max_replicas`` is ``max_replicas`` where given,
    else the section's, else :data:`AUTOSCALE_MAX_REPLICAS`; and a maker of
    a fresh :class:`deploy.sim.fleet.Autoscaling` (the policy keeps state: one per run).

    Raises:
        pydantic.ValidationError: the bounds contradict (``max_replicas < min_replicas``).
    """
    section = config.autoscaling.model_dump() if config.autoscaling else {}
    if max_replicas is not None:
        section["max_replicas"] = max_replicas
    elif section.get("max_replicas") is None:
        section["max_replicas"] = max(AUTOSCALE_MAX_REPLICAS, section.get("min_replicas", 1))
    data = config.model_dump(exclude={"engine": {"model"}})
    data.pop("num_replicas")
    data["autoscaling"] = section
    scaled = ServiceConfig(**data)
    settings = scaled.autoscaling_settings()
    start = settings.replica_start_s if start_s is None else start_s

    def make() -> Autoscaling:
        return Autoscaling(SloAutoscaler(settings, scaled.traffic_classes()), settings, start)

    return scaled, make


def replica_hours(replica_s: float, day_s: float, real_day_s: float = 86400.0) -> float:
    """Replica-seconds of a played day of ``day_s`` as replica-hours of a real day."""
    return replica_s / 3600.0 * (real_day_s / day_s)


def decisions_text(decisions: Sequence) -> str:
    """One line per decision: virtual time, target, reason."""
    return "\n".join(f"  {d.t:9.1f} s  -> {d.target}  {d.reason}" for d in decisions)
