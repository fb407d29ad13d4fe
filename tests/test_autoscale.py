"""The SLO autoscaler (policies/autoscale.py), its window, and autoscaling in the simulator."""

from __future__ import annotations

import argparse

import pytest

from deploy.config import ServiceConfig
from deploy.sim.autoscale import Diurnal, QueueLengthScaler, autoscaling_for, diurnal_requests
from deploy.sim.cli import cost_model
from deploy.sim.fleet import Fleet
from deploy.sim.trace import SimRequest, TraceSpec
from policies import DEFAULT_CLASSES
from policies.autoscale import (
    AutoscalingSettings,
    ClassLoad,
    FleetState,
    ReplicaLoad,
    SloAutoscaler,
)
from policies.scaling_window import ClassWindow

COEF = (0.03, 0.001, 0.002)
"""a, b, c of every test replica: capacity 1 - 0.03 / 0.5 = 0.94 of a second per second
under the interactive TPOT SLO."""


def _policy(**settings) -> SloAutoscaler:
    base = {
        "min_replicas": 1,
        "max_replicas": 8,
        "scale_down_delay_s": 60.0,
        "target_utilization": 0.7,
    }
    return SloAutoscaler(AutoscalingSettings(**(base | settings)), DEFAULT_CLASSES)


def _state(
    now: float,
    running: int,
    *,
    target: int | None = None,
    rps: float = 1.0,
    prompt: int = 200,
    output: int = 50,
    cls: str = "interactive",
    window: float = 30.0,
    **load,
) -> FleetState:
    """``rps`` requests per second of ``cls`` over the window; each costs
    ``0.001 * prompt + 0.002 * output`` seconds of step time."""
    n = round(rps * window)
    loads = {cls: ClassLoad(arrived=n, prompt_tokens=n * prompt, output_tokens=output, **load)}
    return FleetState(
        now_s=now,
        running=running,
        target=running if target is None else target,
        classes=loads,
        replicas=[ReplicaLoad(step_coefficients=COEF) for _ in range(running)],
        window_s=window,
    )


def test_demand_is_the_work_over_each_replicas_capacity_at_the_target_utilization():
    p = _policy()
    # 10 req/s * (0.2 + 0.1) s = 3 s of step time per second; / (0.94 * 0.7) = 4.56.
    need, capped = p.demand_replicas(_state(0, 1, rps=10), 0.7)
    assert need == pytest.approx(3.0 / (0.94 * 0.7))
    assert capped == ""


def test_scales_up_by_what_the_demand_needs_at_once_not_one_at_a_time():
    d = _policy().decide(_state(0, 1, rps=10))
    assert d.target == 5
    assert "demand needs 4.56 replicas: +4" in d.reason


def test_a_class_at_risk_adds_a_replica_when_the_demand_model_says_the_fleet_suffices():
    # The model sees 0.5 replicas of demand, but interactive misses its SLO: the model is
    # wrong, and the fleet grows by one.
    d = _policy().decide(_state(0, 2, rps=1, finished=30, met=27, refused=2))
    assert d.target == 3
    assert d.reason.startswith("interactive attainment 84.4% < 99% and 2 refused")
    assert d.reason.endswith(": +1")


def test_one_miss_is_noise_not_risk():
    d = _policy().decide(_state(0, 2, rps=1, finished=99, met=98, refused=1))
    assert d.target == 2 and not d.at_risk


def test_a_risk_waits_for_the_replicas_already_starting():
    d = _policy().decide(_state(0, 2, target=3, rps=1, finished=30, met=27))
    assert d.target == 3
    assert "1 starting: hold at 3" in d.reason


def test_no_scale_down_while_replicas_start():
    p = _policy(scale_down_delay_s=0.0)
    assert p.decide(_state(0, 2, target=3, rps=0.1)).target == 3
    assert p.decide(_state(5, 3, rps=0.1)).target == 1


def test_a_coefficient_the_fit_left_at_zero_takes_the_prior():
    s = _state(0, 1, rps=10)
    zero_c = FleetState(
        now_s=0,
        running=1,
        target=1,
        classes=s.classes,
        replicas=[ReplicaLoad(step_coefficients=(0.03, 0.001, 0.0))],
        window_s=30.0,
    )
    assert _policy()._coefficients(zero_c) == (0.03, 0.001, 0.002)


def test_a_burst_the_fleet_drains_before_a_replica_could_start_does_not_scale():
    # Plenty of spare capacity (0.5 replicas of demand on 3), a short queue: held past
    # half the wait, but 3 replicas clear 2 prompts long before a 20 s start.
    s = _state(0, 3, rps=1, held=2, oldest_held_s=0.8)
    d = _policy(replica_start_s=20.0).decide(s)
    assert d.target == 3
    assert "drains within a replica's start" in d.reason
    # With a start shorter than the drain, the same state grows the fleet.
    assert _policy(replica_start_s=0.0).decide(s).target == 4


def test_scale_down_needs_a_sustained_surplus_and_a_cooldown_after_scaling_up():
    p = _policy(scale_down_delay_s=60.0)
    assert p.decide(_state(0, 1, rps=10)).target == 5  # up at t=0
    quiet = dict(rps=1.0)  # 0.46 replicas of demand
    assert p.decide(_state(10, 5, **quiet)).target == 5
    held = p.decide(_state(50, 5, **quiet))
    assert held.target == 5 and "would do for 40 s of 60 s" in held.reason
    down = p.decide(_state(70, 5, **quiet))
    assert down.target == 1 and down.reason.endswith(": -4")


def test_hysteresis_keeps_a_fleet_whose_demand_fits_only_at_the_target_utilization():
    p = _policy(scale_down_delay_s=0.0)
    # 4.2 s of work per second: 4.2 / (0.94 * 0.7) = 6.4 -> 7 replicas needed; at the
    # scale-down utilization (0.56) 8 would be: 8 is kept, not shrunk to 7.
    s = _state(0, 8, rps=14)
    assert p.decide(s).target == 8


def test_a_class_that_may_wait_scales_the_fleet_only_to_its_share_of_max():
    p = _policy(max_replicas=8)  # batch's scale_share: 0.5 -> 4 replicas at most
    d = p.decide(_state(0, 1, rps=20, cls="batch"))
    assert d.target == 4
    assert "batch capped at 50% of max" in d.reason
    # A held batch request alone does not grow a fleet already at its share.
    s = _state(0, 4, rps=1, cls="batch", held=5, oldest_held_s=25.0)
    assert p.decide(s).target == 4


def test_bounds_hold():
    p = _policy(min_replicas=2, max_replicas=3)
    assert p.decide(_state(0, 2, rps=100)).target == 3
    assert "at max_replicas" in p.decide(_state(5, 3, rps=100)).reason


@pytest.mark.parametrize(
    "field,value",
    [("min_replicas", 0), ("max_replicas", 0), ("window_s", 1.0), ("target_utilization", 0)],
)
def test_settings_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        AutoscalingSettings(**{"decision_period_s": 5.0, field: value})


def test_window_counts_the_last_window_seconds():
    w = ClassWindow(10.0)
    w.arrived("interactive", 0.0, 100, 20)
    w.arrived("interactive", 5.0, 300, 20)
    w.refused("interactive", 5.0)
    w.finished("interactive", 6.0, True, 10)
    w.finished("interactive", 7.0, False, 30)
    load = w.loads(12.0, held={"batch": [2.0]})
    assert load["interactive"] == ClassLoad(
        arrived=1, prompt_tokens=300, output_tokens=20.0, finished=2, met=1, refused=1
    )
    assert load["interactive"].attainment == pytest.approx(1 / 3)
    assert load["batch"].held == 1 and load["batch"].oldest_held_s == 10.0
    assert w.span_s(3.0) == 3.0 and w.span_s(30.0) == 10.0


def test_ray_default_applies_its_upscale_delay():
    settings = AutoscalingSettings(min_replicas=1, max_replicas=4)
    q = QueueLengthScaler(settings, target_ongoing_requests=2, upscale_delay_s=30.0)
    busy = [ReplicaLoad(running=8)]
    first = q.decide(FleetState(now_s=0.0, running=1, target=1, replicas=busy))
    assert first.target == 1  # wants 4, but only after 30 s of wanting it
    later = q.decide(FleetState(now_s=31.0, running=1, target=1, replicas=busy))
    assert later.target == 4


def _cost():
    return cost_model(
        argparse.Namespace(gpu=None, model_size=None, cost_model=None, tensor_parallel=1)
    )


def test_a_simulated_load_step_scales_up_then_back_down_and_loses_nothing():
    config, make = autoscaling_for(
        ServiceConfig(autoscaling={"scale_down_delay_s": 30.0, "window_s": 20.0}), 4, 10.0
    )
    # 60 s at 0.5 req/s, 120 s at 8 req/s, 240 s at 0.5 req/s.
    reqs, t = [], 0.0
    for rate, until in ((0.5, 60.0), (8.0, 180.0), (0.5, 420.0)):
        while t < until:
            reqs.append(SimRequest(f"r{len(reqs)}", t, 200, 40, "interactive"))
            t += 1 / rate
    run = Fleet(config, _cost(), autoscaling=make()).run(reqs)
    targets = [d.target for d in run.decisions]
    assert max(targets) >= 2, run.decisions
    assert targets[-1] == 1, run.decisions
    first_up = next(d for d in run.decisions if d.target > 1)
    assert 60.0 < first_up.t < 180.0
    assert all(o.status in ("ok", "refused") for o in run.outcomes)
    # Replica-seconds: at least one replica all along, less than the peak all along.
    assert run.end_s <= run.replica_s < max(targets) * run.end_s


def test_diurnal_thinning_follows_the_envelope():
    curve = Diurnal(day_s=3600.0, peak_rps=4.0)
    reqs = diurnal_requests(TraceSpec("conv", length_scale=4.0), curve)
    night = sum(r.arrival_s < 600 for r in reqs) / 600
    noon = sum(1500 <= r.arrival_s < 2100 for r in reqs) / 600
    assert noon / night > 2.0
    assert len(reqs) / 3600 == pytest.approx(curve.mean_rate(), rel=0.1)
