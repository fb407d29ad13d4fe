"""The digital twin's drift: engine.core.step_drift.DriftMonitor on synthetic steps, the config
key that gives it a model, and `iterserve top`'s view of the ratio."""

from __future__ import annotations

import pydantic
import pytest
from rich.console import Console

from deploy.config import ServiceConfig
from deploy.top import render, view
from engine.core.interfaces import StepRecord
from engine.core.step_cost import LinearCost, StepShape
from engine.core.step_drift import DriftMonitor
from engine.core.step_log import IDLE_GAP_S

# 10 ms a step, 1 ms per decode, 0.1 ms per prefill token.
COST = LinearCost((0.01, 1e-4, 1e-3, 0.0, 0.0), 64, 16, 2048, 1000)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def record(i: int, start: float, seconds: float, decodes: int, prefill: int) -> StepRecord:
    seqs = tuple((f"d{j}", 10, 1) for j in range(decodes))
    if prefill:
        seqs += (("p", 0, prefill),)
    return StepRecord(
        index=i,
        start=start,
        seconds=seconds,
        schedule_s=0.0,
        tokens_at=seconds,
        phases=(),
        predicted_s=0.0,
        num_decodes=decodes,
        num_prefill_tokens=prefill,
        num_waiting=0,
        num_running=decodes,
        seqs=seqs,
        preempted=(),
        prefill_cap=float("inf"),
        owed_cap=float("inf"),
        sat_out=(),
        shed=(),
    )


def predicted(decodes: int, prefill: int) -> float:
    return COST.step_seconds(StepShape.of_record(record(0, 0, 0, decodes, prefill).seqs, decodes))


def run(monitor: DriftMonitor, clock: Clock, steps: list[tuple[int, int]], slowdown: float) -> None:
    """Back to back, steps of ``(decodes, prefill tokens)`` that each take ``slowdown``
    times the model's seconds."""
    for i, (d, p) in enumerate(steps):
        seconds = slowdown * predicted(d, p)
        monitor.step(record(i, clock.t, seconds, d, p))
        clock.t += seconds


def test_steps_twice_as_long_as_the_model_give_half_per_kind():
    clock = Clock()
    m = DriftMonitor(COST, clock=clock)
    run(m, clock, [(4, 0), (4, 100), (0, 300)] * 10, slowdown=2.0)
    clock.t += 1.0  # idle: the last step's time is its own
    r = m.ratios()
    for kind in ("decode", "mixed", "prefill"):
        ratio, n = r[kind]
        assert ratio == pytest.approx(0.5) and n == 10, (kind, r)
    d = m.to_dict()
    assert d["decode"] == {"ratio": pytest.approx(0.5), "steps": 10}


def test_the_period_runs_to_the_next_start_unless_idleness_follows():
    clock = Clock()
    m = DriftMonitor(COST, clock=clock)
    p = predicted(2, 0)
    # Ran p/2, then a serving gap of p/2 before the next step: measured p.
    m.step(record(0, clock.t, p / 2, 2, 0))
    clock.t += p
    assert m.ratios()["decode"] == (None, 0)  # its period is not known yet
    m.step(record(1, clock.t, p / 2, 2, 0))
    assert m.ratios()["decode"] == (pytest.approx(1.0), 1)
    # Idle after it: the step counts its own seconds, once the idleness shows.
    clock.t += p / 2 + IDLE_GAP_S / 2
    assert m.ratios()["decode"][1] == 1
    clock.t += IDLE_GAP_S
    assert m.ratios()["decode"] == (pytest.approx(2 * p / (p + p / 2)), 2)
    # A step after a long idle gap does not count the gap in its predecessor.
    m2 = DriftMonitor(COST, clock=clock)
    m2.step(record(0, clock.t, p, 2, 0))
    clock.t += 5.0
    m2.step(record(1, clock.t, p, 2, 0))
    assert m2.ratios()["decode"] == (pytest.approx(1.0), 1)


def test_old_steps_fall_out_of_the_window():
    clock = Clock()
    m = DriftMonitor(COST, clock=clock, window_s=60.0)
    run(m, clock, [(4, 0)] * 20, slowdown=2.0)
    clock.t += 30.0
    run(m, clock, [(4, 0)] * 20 + [(0, 200)] * 5, slowdown=1.0)
    clock.t += 1.0
    assert m.ratios()["decode"] == (pytest.approx(40 / 60), 40)
    clock.t += 31.0  # the slow ones are older than a minute now
    assert m.ratios()["decode"] == (pytest.approx(1.0), 20)
    assert m.ratios()["prefill"] == (pytest.approx(1.0), 5)
    clock.t += 60.0
    assert m.to_dict() == {k: {"ratio": None, "steps": 0} for k in ("decode", "mixed", "prefill")}


def test_without_a_model_it_fits_its_own_on_its_first_steps():
    clock = Clock()
    m = DriftMonitor(clock=clock, fit_steps=40, warmup_steps=3)
    shapes = [(d, p) for d in (0, 1, 4, 9) for p in (0, 50, 300) if d or p] * 6
    # Warm-up (slow, left out), then the fit's steps at the model's times.
    run(m, clock, [(4, 0)] * 3, slowdown=5.0)
    run(m, clock, shapes[:40], slowdown=1.0)
    assert not m.fitted
    assert all(r == (None, 0) for r in m.ratios().values())
    run(m, clock, shapes[40:42], slowdown=1.0)
    assert m.fitted
    assert m.cost.step_seconds(StepShape.of_record(record(0, 0, 0, 6, 120).seqs, 6)) == (
        pytest.approx(predicted(6, 120), rel=1e-6)
    )
    # The replica slows down by a quarter: the twin fitted on its start says 0.8.
    clock.t += 1.0
    run(m, clock, shapes, slowdown=1.25)
    clock.t += 1.0
    ratios = m.ratios()
    for kind in ("decode", "mixed", "prefill"):
        assert ratios[kind][0] == pytest.approx(0.8, rel=0.05), (kind, ratios)


def test_a_clock_that_cannot_time_steps_never_fits_nor_stops_the_engine():
    clock = Clock()
    m = DriftMonitor(clock=clock, fit_steps=10, warmup_steps=0)
    run(m, clock, [(2, 0)] * 50, slowdown=0.0)  # every step 0 s: no relative error
    assert not m.fitted
    run(m, clock, [(2, 0), (2, 100), (0, 50), (1, 300)] * 4, slowdown=1.0)
    assert m.fitted


def test_the_window_stays_bounded_when_nobody_reads_it():
    clock = Clock()
    m = DriftMonitor(COST, clock=clock, window_s=1.0)
    run(m, clock, [(4, 0)] * 1000, slowdown=1.0)  # 14 s of steps
    assert len(m._window) <= 1.0 / predicted(4, 0) + 2


def test_attach_keeps_the_step_listeners_added_before():
    from engine.llm_engine import LLMEngine

    clock, seen = Clock(), []

    class Engine:
        """What attach touches: the engine's step listeners."""

        add_step_listener = LLMEngine.add_step_listener

        def __init__(self) -> None:
            self.step_listeners = [seen.append]

    engine = Engine()
    m = DriftMonitor(COST, clock=clock)
    m.attach(engine)
    assert engine.step_listeners == [seen.append, m.step]
    for listener in engine.step_listeners:
        listener(record(0, clock.t, 0.01, 1, 0))
    assert len(seen) == 1 and m._pending is not None


def test_twin_cost_model_must_be_a_calibration_file(tmp_path):
    good = tmp_path / "cost.json"
    COST.save(good)
    config = ServiceConfig(twin_cost_model=str(good))
    assert config.twin_cost() == COST
    assert ServiceConfig().twin_cost() is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "roofline"}')
    for path, words in (
        (bad, "not a calibrated cost model"),
        (tmp_path / "missing.json", "cannot be read"),
    ):
        with pytest.raises(pydantic.ValidationError, match="twin_cost_model") as e:
            ServiceConfig(twin_cost_model=str(path))
        assert words in str(e.value) and "iterserve calibrate" in str(e.value)
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(pydantic.ValidationError, match="not JSON"):
        ServiceConfig(twin_cost_model=str(tmp_path / "junk.json"))


def test_top_shows_the_ratio_per_replica_and_kind():
    name = "iterserve:step_time_prediction_ratio"
    now = {
        (name, (("kind", "decode"), ("model", "m"), ("replica", "r1"))): 0.5,
        (name, (("kind", "prefill"), ("model", "m"), ("replica", "r1"))): 1.04,
        ("iterserve:kv_cache_usage_perc", (("model", "m"), ("replica", "r1"))): 0.25,
        ("iterserve:kv_cache_usage_perc", (("model", "m"), ("replica", "r2"))): 0.0,
    }
    v = view(now, {}, 1.0, True)
    assert v.twin == {"r1": {"decode": 0.5, "prefill": 1.04}}
    console = Console(width=160, record=True)
    console.print(render(v, "http://x"))
    lines = console.export_text().splitlines()
    r1 = next(ln for ln in lines if "│ r1 " in ln)
    cells = [c.strip() for c in r1.split("│")[1:-1]]
    assert cells[-3:] == ["0.50", "-", "1.04"], cells
    r2 = next(ln for ln in lines if "│ r2 " in ln)
    assert [c.strip() for c in r2.split("│")[1:-1]][-3:] == ["-", "-", "-"]
