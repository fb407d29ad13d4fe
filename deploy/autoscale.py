"""The SLO autoscaler on Ray Serve: :class:`ServePolicy`, the model deployment's custom
autoscaling policy.

Ray Serve runs it in its controller, once per control loop, with an
``AutoscalingContext``; the controller knows only what the model replicas return from
``record_autoscaling_stats``. So the signal path is:

1. the ingress counts each class's arrivals, refusals, finishes within and outside SLO,
   and held requests over ``window_s`` (:class:`router.scaling.ScalingSignals`) and
   sends them, every ``decision_period_s``, to every replica
   (``ModelReplica.autoscale_signals``);
2. each replica returns them with its own load (running, waiting, KV usage, recent
   step seconds, prefill tokens still to compute, step-time fit) from
   ``ModelReplica.record_autoscaling_stats``, which Serve records and pushes to the
   controller every ``metrics_interval_s`` (set to ``decision_period_s`` by
   :func:`deploy.app.build_app`);
3. here, every ``decision_period_s``, :func:`fleet_state` reads each replica's latest
   record and the freshest ingress counts among them, and
   :class:`policies.autoscale.SloAutoscaler` decides.

Each decision whose target, or the words of whose reason, changed is logged (logger
``iterserve.autoscale``, to the controller's stderr, which Ray also streams to the
``iterserve serve`` console), and every decision is published in the cluster's key-value
store (:func:`router.scaling_store.publish_decision`), where the ingress reads it for
``/health`` and ``iterserve:num_replicas_target``.

Serve pickles this module by value into its controller; what it imports (``policies``,
``router``) must be importable there, as for the replicas.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from policies import make_classes
from policies.autoscale import AutoscalingSettings, FleetState, ScalingDecision, SloAutoscaler
from policies.scaling_signals import IngressSignals, decode_classes, decode_replica
from router.scaling import ScalingRecord
from router.scaling_store import publish_decision

logger = logging.getLogger("iterserve.autoscale")


class TimedValue(Protocol):
    """One point of a replica's metric series (Ray Serve's ``TimeStampedValue``)."""

    @property
    def timestamp(self) -> float: ...

    @property
    def value(self) -> float: ...


class PolicyContext(Protocol):
    """What :class:`ServePolicy` reads of Ray Serve's ``AutoscalingContext``."""

    @property
    def app_name(self) -> str: ...

    @property
    def deployment_name(self) -> str: ...

    @property
    def current_num_replicas(self) -> int: ...

    @property
    def target_num_replicas(self) -> int: ...

    @property
    def running_replicas(self) -> Sequence[object]: ...

    @property
    def raw_metrics(self) -> Mapping[str, Mapping[object, Sequence[TimedValue]]] | None: ...


def latest_records(ctx: PolicyContext) -> list[dict[str, float]]:
    """Each running replica's last ``record_autoscaling_stats`` (the series' points at its
    latest time; a key not in that record, from an older one, is left out). Replicas
    without a record yet are left out."""
    per_replica: dict[object, dict[str, TimedValue]] = {}
    for name, by_replica in (ctx.raw_metrics or {}).items():
        for rid, series in by_replica.items():
            if series:
                per_replica.setdefault(rid, {})[name] = series[-1]
    out = []
    for rid in ctx.running_replicas:
        points = per_replica.get(rid)
        if not points:
            continue
        last = max(p.timestamp for p in points.values())
        out.append({k: float(p.value) for k, p in points.items() if p.timestamp == last})
    return out


def freshest_signals(records: Sequence[Mapping[str, float]]) -> IngressSignals | None:
    """The ingress's latest counts among the replicas' records (None: none has any)."""
    found = [s for s in map(decode_classes, records) if s is not None]
    return max(found, key=lambda s: s.at, default=None)


def fleet_state(
    ctx: PolicyContext, now_s: float, wall_s: float, max_age_s: float
) -> tuple[FleetState | None, str]:
    """The policy's input from Serve's context; None and why when the ingress's counts are
    missing or older than ``max_age_s`` (then no decision should be made on them).

    Args:
        now_s: the policy's clock (monotonic seconds).
        wall_s: Unix seconds now, to age the ingress's stamp with.
        max_age_s: the oldest ingress counts still used (``window_s``: past it they tell
            nothing of the window now).
    """
    records = latest_records(ctx)
    replicas = [r for r in map(decode_replica, records) if r is not None]
    signals = freshest_signals(records)
    if signals is None:
        return None, "no traffic counts from the ingress yet"
    age = wall_s - signals.at
    if age > max_age_s:
        return None, f"the ingress's traffic counts are {age:.0f} s old"
    state = FleetState(
        now_s=now_s,
        running=ctx.current_num_replicas,
        target=ctx.target_num_replicas,
        classes=signals.classes,
        replicas=replicas,
        window_s=signals.window_s,
    )
    return state, ""


def _words(reason: str) -> str:
    """A reason without its numbers: two decisions for the same reason compare equal."""
    return re.sub(r"[-+]?\d+(\.\d+)?%?", "#", reason)


class ServePolicy:
    """Ray Serve's deployment-scoped autoscaling policy (a class: Serve builds it once in
    its controller with ``policy_kwargs`` and calls it at every control loop).

    Args:
        settings: :class:`policies.autoscale.AutoscalingSettings` fields.
        traffic_classes: every class's fields (``ServiceConfig.traffic_classes``).
        log_to_stderr: give the ``iterserve.autoscale`` logger a stderr handler at INFO
            if it has none (the controller configures only Serve's own loggers).
        clock: the policy's clock (monotonic seconds).
        wall: Unix seconds.
        publish: where each decision goes for the ingress
            (:func:`router.scaling_store.publish_decision`).

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        traffic_classes: Mapping[str, Mapping[str, Any]] | None = None,
        log_to_stderr: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        publish: Callable[[str, str, ScalingRecord], None] = publish_decision,
    ) -> None:
        self.settings = AutoscalingSettings(**settings)
        self.autoscaler = SloAutoscaler(self.settings, make_classes(traffic_classes))
        self.clock, self.wall, self.publish = clock, wall, publish
        self.last: ScalingDecision | None = None
        self._decided_at: float | None = None
        self._logged: tuple[int, str] | None = None
        if log_to_stderr and not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False

    def __call__(self, ctx: PolicyContext) -> tuple[int, dict[str, Any]]:
        """``(target replicas, policy state)`` for Serve's ``AutoscalingContext``: the
        autoscaler's decision every ``decision_period_s``, the current target between."""
        now = self.clock()
        s = self.settings
        if self._decided_at is not None and now - self._decided_at < s.decision_period_s:
            return ctx.target_num_replicas, {}
        self._decided_at = now
        state, why_not = fleet_state(ctx, now, self.wall(), max_age_s=s.window_s)
        if state is None:
            target = max(s.min_replicas, min(s.max_replicas, ctx.target_num_replicas))
            decision = ScalingDecision(target, f"{why_not}: hold at {target}", 0.0)
        else:
            decision = self.autoscaler.decide(state)
        self.last = decision
        self._report(ctx, decision)
        return decision.target, {}

    def _report(self, ctx: PolicyContext, decision: ScalingDecision) -> None:
        key = (decision.target, _words(decision.reason))
        if key != self._logged:
            self._logged = key
            logger.info(
                "target %d (running %d): %s",
                decision.target,
                ctx.current_num_replicas,
                decision.reason,
            )
        record = ScalingRecord(
            decision.target, decision.reason, ctx.current_num_replicas, self.wall()
        )
        try:
            self.publish(ctx.app_name, ctx.deployment_name, record)
        except Exception as e:  # noqa: BLE001 - the store is for display; scaling goes on
            logger.warning("cannot publish the decision: %s: %s", type(e).__name__, e)


__all__ = ["ServePolicy", "fleet_state", "freshest_signals", "latest_records"]
