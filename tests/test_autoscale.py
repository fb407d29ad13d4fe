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
from policies.step_time import StepTimeModel

COEF = (0.03, 0.001, 0.002)
"""a, b, c of every test replica: capacity 1 - 0.03 / 0.5 = 0.94 of a second per second
under the interactive TPOT SLO."""


def _policy(**settings) -> SloAutoscaler:
    # No upscale delay unless a test sets one: the tests of the delay set it.
    base = {
        "min_replicas": 1,
        "max_replicas": 8,
        "scale_down_delay_s": 60.0,
        "upscale_delay_s": 0.0,
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
    warm: bool = True,
    **load,
) -> FleetState:
    """``rps`` requests per second of ``cls`` over the window; each costs
    ``0.001 * prompt + 0.002 * output`` seconds of step time; ``warm``: the replicas'
    step-time fits are."""
    n = round(rps * window)
    loads = {cls: ClassLoad(arrived=n, prompt_tokens=n * prompt, output_tokens=output, **load)}
    return FleetState(
        now_s=now,
        running=running,
        target=running if target is None else target,
        classes=loads,
        replicas=[ReplicaLoad(step_coefficients=COEF, step_fit_warm=warm) for _ in range(running)],
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


# -- the first minute (issue "endure", section 6) ----------------------------------------------

COLD_START_STEPS = ((0.5, 120.0), (8.0, 60.0))
"""The cold-start schedule, live and simulated: (requests per second, seconds), from the
first request; prompts of about ``COLD_START_PROMPT`` tokens, ``COLD_START_OUTPUT`` out."""
COLD_START_PROMPT, COLD_START_OUTPUT = 200, 48
STEP_SCALES_UP_WITHIN_S = 60.0


def _light(now: float, window: float, coef: tuple[float, float, float], warm: bool) -> FleetState:
    """0.5 requests/s of ``standard`` (200 prompt, 48 output tokens) for ``window`` seconds
    on one replica whose fit is ``coef``."""
    n = round(0.5 * window)
    return FleetState(
        now_s=now,
        running=1,
        target=1,
        classes={"standard": ClassLoad(arrived=n, prompt_tokens=200 * n, output_tokens=48)},
        replicas=[ReplicaLoad(step_coefficients=coef, step_fit_warm=warm)],
        window_s=window,
    )


COLD = (0.0, 0.006, 0.03)
"""A fit that still holds a new process's first steps (one-off costs on the slopes)."""


def test_a_first_window_not_yet_full_does_not_scale_up():
    # 20 s after the first request, with a fit that prices the light load at more than one
    # replica, as a fit on a new replica's first steps can (reported warm here, so that
    # the window alone holds the fleet): the policy once added a replica here.
    p = _policy(max_replicas=2)
    d = p.decide(_light(20.0, 20.0, COLD, warm=True))
    assert d.demand_replicas > 1.0
    assert d.target == 1 and "(window 20 s of 30 s): hold at 1" in d.reason
    # Ten seconds later the window is full and a warm fit prices the same load.
    later = p.decide(_light(30.0, 30.0, COEF, warm=True))
    assert later.target == 1 and later.demand_replicas < 0.3


def test_a_cold_step_time_fit_does_not_scale_up():
    p = _policy(max_replicas=2)
    d = p.decide(_light(30.0, 30.0, COLD, warm=False))
    assert d.demand_replicas > 1.0
    assert d.target == 1 and "(step-time fit cold): hold at 1" in d.reason


def test_a_new_replicas_cold_fit_does_not_price_the_demand():
    s = _state(0, 2, rps=10)
    joined = FleetState(
        now_s=0,
        running=2,
        target=2,
        classes=s.classes,
        replicas=[*s.replicas, ReplicaLoad(step_coefficients=COLD)],
        window_s=30.0,
    )
    assert _policy()._coefficients(joined) == COEF


def test_the_demand_adds_replicas_once_it_has_asked_for_upscale_delay_s():
    p = _policy(upscale_delay_s=30.0)
    for t in range(0, 30, 5):
        d = p.decide(_state(t, 1, rps=10))
        assert d.target == 1 and f"(for {t} s of 30 s): hold at 1" in d.reason
    assert p.decide(_state(30, 1, rps=10)).target == 5
    # A reading that fits the fleet starts the count over.
    p = _policy(upscale_delay_s=30.0)
    assert p.decide(_state(0, 1, rps=10)).target == 1
    assert p.decide(_state(20, 1, rps=1)).target == 1
    assert p.decide(_state(30, 1, rps=10)).target == 1
    assert p.decide(_state(60, 1, rps=10)).target == 5
    # The count runs from the first ask, while the window fills and the fit warms; the
    # demand adds replicas once all three hold.
    p = _policy(upscale_delay_s=30.0)
    assert "(window 20 s of 30 s)" in p.decide(_state(0, 1, rps=10, window=20.0)).reason
    assert "(step-time fit cold)" in p.decide(_state(20, 1, rps=10, warm=False)).reason
    assert "(for 25 s of 30 s)" in p.decide(_state(25, 1, rps=10)).reason
    assert p.decide(_state(30, 1, rps=10)).target == 5


def test_a_class_at_risk_adds_a_replica_at_once_while_the_demand_waits():
    p = _policy(upscale_delay_s=30.0)
    d = p.decide(_state(0, 1, rps=10, window=10.0, finished=30, met=20))
    assert d.target == 2 and "(window 10 s of 30 s)" in d.reason and d.reason.endswith(": +1")
    d = p.decide(_state(0, 1, rps=10, warm=False, finished=30, met=20))
    assert d.target == 2 and d.reason.endswith(": +1")


def test_a_step_time_fit_is_warm_once_its_window_is_full():
    m = StepTimeModel(window=8, min_samples=4)
    for k in range(7):
        m.observe(100 if k % 3 == 0 else 0, 1 + k % 2, 0.05)
        assert not m.warm
    m.observe(0, 1, 0.05)
    assert m.warm


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


def cold_start_requests() -> list[SimRequest]:
    """:data:`COLD_START_STEPS` as arrivals at even intervals."""
    reqs, t, end = [], 0.0, 0.0
    for rate, span in COLD_START_STEPS:
        end += span
        while t < end - 1e-9:
            reqs.append(
                SimRequest(f"r{len(reqs)}", t, COLD_START_PROMPT, COLD_START_OUTPUT, "standard")
            )
            t += 1 / rate
    return reqs


def test_a_simulated_cold_start_holds_at_a_light_load_and_scales_up_after_a_step():
    # As the live test (test_autoscale_live.py) runs it: 1 to 2 replicas, the defaults.
    config, make = autoscaling_for(
        ServiceConfig(num_replicas="auto", replica_num_cpus=1, autoscaling={"max_replicas": 2}),
        None,
        None,
    )
    fleet = Fleet(config, _cost(), autoscaling=make())
    run = fleet.run(cold_start_requests())
    step_s = COLD_START_STEPS[0][1]
    assert not [d for d in run.decisions if d.t < step_s], run.decisions
    up = run.decisions[0]
    assert up.target == 2 and up.t <= step_s + STEP_SCALES_UP_WITHIN_S, run.decisions
    assert fleet.fleet_state().replicas[0].step_fit_warm  # the engine reports its fit's


def test_diurnal_thinning_follows_the_envelope():
    curve = Diurnal(day_s=3600.0, peak_rps=4.0)
    reqs = diurnal_requests(TraceSpec("conv", length_scale=4.0), curve)
    night = sum(r.arrival_s < 600 for r in reqs) / 600
    noon = sum(1500 <= r.arrival_s < 2100 for r in reqs) / 600
    assert noon / night > 2.0
    assert len(reqs) / 3600 == pytest.approx(curve.mean_rate(), rel=0.1)
