"""The autoscaler's Ray glue without a Ray cluster: the signals' wire format, the ingress's
counts, Serve's context turned into the policy's input, and ServePolicy's decisions."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import pytest

from deploy.autoscale import ServePolicy, fleet_state, latest_records
from deploy.config import ServiceConfig
from policies import DEFAULT_CLASSES, LoadSnapshot
from policies.autoscale import AutoscalingSettings, ClassLoad, ReplicaLoad
from policies.scaling_signals import (
    decode_classes,
    decode_replica,
    encode_classes,
    encode_replica,
    replica_load,
)
from router.metrics import IngressMetrics
from router.scaling import ScalingRecord, ScalingSignals

CLASSES = {name: asdict(c) for name, c in DEFAULT_CLASSES.items()}
SETTINGS = AutoscalingSettings(
    min_replicas=1,
    max_replicas=3,
    decision_period_s=1.0,
    window_s=10.0,
    scale_down_delay_s=5.0,
    upscale_delay_s=0.0,
)


@dataclass
class Point:
    timestamp: float
    value: float


@dataclass
class Context:
    """The fields of Ray Serve's AutoscalingContext that ServePolicy reads."""

    current_num_replicas: int = 1
    target_num_replicas: int = 1
    running_replicas: list[str] = field(default_factory=lambda: ["r1"])
    raw_metrics: dict[str, dict[str, list[Point]]] = field(default_factory=dict)
    app_name: str = "iterserve"
    deployment_name: str = "ModelReplica"

    def record(self, replica: str, t: float, values: dict[str, float]) -> None:
        """One ``record_autoscaling_stats`` of ``replica`` at ``t``."""
        for k, v in values.items():
            self.raw_metrics.setdefault(k, {}).setdefault(replica, []).append(Point(t, v))


BUSY = ReplicaLoad(
    running=4,
    waiting=2,
    kv_usage=0.5,
    step_s=0.2,
    waiting_prefill_tokens=300,
    step_coefficients=(0.02, 0.0005, 0.004),
    step_fit_warm=True,
)


def heavy(at: float) -> dict[str, float]:
    """Ingress counts whose demand needs more than one replica, taken at ``at``."""
    loads = {"standard": ClassLoad(arrived=400, prompt_tokens=400 * 500, output_tokens=100)}
    return encode_classes(loads, 10.0, at)


# -- the wire format ----------------------------------------------------------------------


def test_class_and_replica_signals_round_trip():
    loads = {
        "interactive": ClassLoad(3, 120, 16.5, 2, 1, 1, 1, 0.7),
        "batch:nightly": ClassLoad(arrived=1, prompt_tokens=9),
    }
    flat = encode_classes(loads, 7.5, 1234.0)
    assert all(isinstance(v, float) for v in flat.values())
    got = decode_classes({**flat, **encode_replica(BUSY), "running_requests": 3.0})
    assert got.at == 1234.0 and got.window_s == 7.5
    assert got.classes == loads  # a colon in a class name survives
    assert isinstance(got.classes["interactive"].arrived, int)
    assert decode_replica({**flat, **encode_replica(BUSY)}) == BUSY
    assert decode_classes(encode_replica(BUSY)) is None
    assert decode_replica(flat) is None
    # A class with a field missing is dropped, not half-read.
    del flat["class:interactive:held"]
    assert set(decode_classes(flat).classes) == {"batch:nightly"}


def test_replica_load_reads_the_snapshot():
    snap = LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=8,
        num_kv_blocks_free=10,
        running_seqs={"standard": 2, "batch": 1},
        waiting_requests={"standard": 4},
        waiting_prefill_tokens={"standard": 100, "batch": 20},
        kv_usage=0.25,
        recent_step_s=0.15,
        step_coefficients=(0.01, 0.001, 0.002),
    )
    assert replica_load(snap) == ReplicaLoad(3, 4, 0.25, 0.15, 120, (0.01, 0.001, 0.002))


# -- the ingress's counts -----------------------------------------------------------------


def test_ingress_counts_every_class_with_held_requests_and_outcomes():
    now = [100.0]
    held = {"interactive": [98.0]}
    signals = ScalingSignals(
        DEFAULT_CLASSES, 10.0, lambda: held, clock=lambda: now[0], wall=lambda: 5000.0
    )
    signals.arrived("interactive", 95.0, 50, 10)
    signals.arrived("interactive", 98.0, 70, 10)
    signals.refused("interactive")
    signals.ended("interactive", True, 12)
    signals.ended("interactive", False, 8)
    got = decode_classes(signals.encode())
    assert got.at == 5000.0 and got.window_s == pytest.approx(5.0)  # since the first event
    assert set(got.classes) == set(DEFAULT_CLASSES)
    assert got.classes["interactive"] == ClassLoad(
        arrived=2,
        prompt_tokens=120,
        output_tokens=10.0,
        finished=2,
        met=1,
        refused=1,
        held=1,
        oldest_held_s=2.0,
    )
    assert got.classes["batch"] == ClassLoad()
    now[0] = 120.0  # the window moved past every event
    assert decode_classes(signals.encode()).classes["interactive"].arrived == 0


def test_request_ends_reach_the_ingress_counts():
    ends = []
    m = IngressMetrics("m", {"standard": (1.0, 0.5)}, dict, dict, lambda: 1, 1)
    m.on_end = lambda *a: ends.append(a)
    r = m.request("standard", m.clock(), 10)
    r.tokens(1)
    r.tokens(1, ["stop"])
    r.finished()
    r.finished()  # a second end is ignored
    lost = m.request("standard", m.clock(), 10)
    lost.tokens(3)
    lost.failed()
    m.request("standard", m.clock(), 10).aborted()  # the client left: no outcome
    assert ends == [("standard", True, 2), ("standard", False, 3)]


# -- Serve's context -> FleetState ----------------------------------------------------------


def test_latest_records_keep_only_each_replicas_last_record():
    ctx = Context(running_replicas=["r1", "r2"])
    ctx.record("r1", 10.0, {**heavy(1000.0), "class:gone:arrived": 1.0})
    ctx.record("r1", 11.0, {**heavy(1001.0), **encode_replica(BUSY)})
    ctx.record("r3", 11.0, heavy(1002.0))  # stopped: not running
    # r2 has not recorded yet
    (only,) = latest_records(ctx)
    assert only["ingress_at"] == 1001.0
    assert "class:gone:arrived" not in only  # from an older record
    assert decode_replica(only) == BUSY


def test_fleet_state_takes_the_freshest_counts_and_every_replicas_load():
    ctx = Context(current_num_replicas=2, target_num_replicas=3, running_replicas=["r1", "r2"])
    idle = ReplicaLoad(step_coefficients=(0.03, 0.001, 0.005))
    ctx.record("r1", 50.0, {**encode_replica(BUSY), **heavy(1000.0)})
    fresher = encode_classes({"batch": ClassLoad(arrived=2)}, 4.0, 1003.0)
    ctx.record("r2", 49.0, {**encode_replica(idle), **fresher})
    state, why = fleet_state(ctx, now_s=7.0, wall_s=1005.0, max_age_s=10.0)
    assert why == ""
    assert (state.now_s, state.running, state.target, state.window_s) == (7.0, 2, 3, 4.0)
    assert state.classes == {"batch": ClassLoad(arrived=2)}
    assert sorted(state.replicas, key=lambda r: r.running) == [idle, BUSY]


def test_fleet_state_refuses_missing_or_stale_counts():
    ctx = Context()
    ctx.record("r1", 1.0, encode_replica(BUSY))
    state, why = fleet_state(ctx, 0.0, 1000.0, max_age_s=10.0)
    assert state is None and "no traffic counts" in why
    ctx.record("r1", 2.0, {**encode_replica(BUSY), **heavy(980.0)})
    state, why = fleet_state(ctx, 0.0, 1000.0, max_age_s=10.0)
    assert state is None and "20 s old" in why


# -- ServePolicy ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def policy(clock: Clock, published: list) -> ServePolicy:
    return ServePolicy(
        SETTINGS.model_dump(),
        CLASSES,
        log_to_stderr=False,
        clock=clock,
        wall=lambda: 1000.0 + clock.t,
        publish=lambda app, dep, rec: published.append((app, dep, rec)),
    )


def test_serve_policy_scales_on_the_ingress_counts_once_a_period(caplog):
    clock, published = Clock(), []
    p = policy(clock, published)
    ctx = Context()
    ctx.record("r1", 1.0, {**encode_replica(BUSY), **heavy(1000.0)})
    caplog.set_level(logging.INFO, logger="iterserve.autoscale")
    target, state = p(ctx)
    assert target >= 2 and target <= SETTINGS.max_replicas and state == {}
    assert p.last.target == target and "demand needs" in p.last.reason
    assert published == [
        ("iterserve", "ModelReplica", ScalingRecord(target, p.last.reason, 1, 1000.0))
    ]
    # Within the period: Serve's current target, no new decision.
    clock.t = 0.5
    assert p(Context(target_num_replicas=target)) == (target, {})
    assert len(published) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "iterserve.autoscale"]
    assert logged == [f"target {target} (running 1): {p.last.reason}"]


def test_serve_policy_holds_without_counts_and_logs_only_changes(caplog):
    clock, published = Clock(), []
    p = policy(clock, published)
    caplog.set_level(logging.INFO, logger="iterserve.autoscale")
    ctx = Context(target_num_replicas=2, current_num_replicas=2, running_replicas=["r1", "r2"])
    for _ in range(3):
        assert p(ctx)[0] == 2
        clock.t += 1.0
    assert p.last.reason == "no traffic counts from the ingress yet: hold at 2"
    assert len(published) == 3
    assert len([r for r in caplog.records if r.name == "iterserve.autoscale"]) == 1
    # Idle counts: the surplus countdown changes its numbers, not its words.
    quiet = encode_classes({"standard": ClassLoad()}, 10.0, 0.0)
    for _ in range(int(SETTINGS.scale_down_delay_s) + 2):
        ctx.record("r1", clock.t, {**encode_replica(BUSY), **quiet, "ingress_at": 1000 + clock.t})
        target, _ = p(ctx)
        if target == 1:
            break
        clock.t += 1.0
    assert target == 1 and "fit for" in p.last.reason
    logged = [r.getMessage() for r in caplog.records if r.name == "iterserve.autoscale"]
    assert len(logged) == 3, logged  # hold (no counts), hold (countdown), down
    assert logged[-1].startswith("target 1 (running 2): ")


def test_serve_policy_builds_from_build_apps_kwargs():
    from deploy.app import autoscaling_config

    config = ServiceConfig(
        num_replicas="auto",
        autoscaling={"max_replicas": 3, "decision_period_s": 2, "window_s": 2},
    )
    settings = config.autoscaling_settings()
    classes = {name: asdict(c) for name, c in config.traffic_classes().items()}
    ac = autoscaling_config(settings, classes)
    assert (ac.min_replicas, ac.initial_replicas, ac.max_replicas) == (1, 1, 3)
    assert ac.upscale_delay_s == ac.downscale_delay_s == 0
    assert ac.metrics_interval_s == 2 and ac.look_back_period_s == 4
    assert ac.policy.policy_function == "deploy.autoscale:ServePolicy"
    built = ServePolicy(**ac.policy.policy_kwargs, log_to_stderr=False)
    assert built.settings == settings
    assert built.autoscaler.classes == config.traffic_classes()
    assert config.ingress_settings().autoscaling == settings.model_dump()
    assert ServiceConfig().ingress_settings().autoscaling is None


def test_check_resources_refuses_min_and_warns_for_max(monkeypatch):
    from deploy import server

    monkeypatch.setattr(server.ray, "cluster_resources", lambda: {"CPU": 2.0})
    config = ServiceConfig(num_replicas="auto", autoscaling={"max_replicas": 5})
    warning = server.check_resources(config)
    assert "max_replicas=5" in warning and "stops at 2 replicas" in warning
    fitting = ServiceConfig(num_replicas="auto", autoscaling={"max_replicas": 2})
    assert server.check_resources(fitting) is None
    with pytest.raises(server.ServeError, match="min_replicas"):
        server.check_resources(ServiceConfig(num_replicas="auto", autoscaling={"min_replicas": 3}))


def test_an_autoscaled_config_reads_back_from_its_dump():
    config = ServiceConfig(num_replicas="auto", autoscaling={"min_replicas": 2, "max_replicas": 3})
    again = ServiceConfig(**config.model_dump(mode="json", exclude_none=True))
    assert again == config and again.num_replicas == 2
    with pytest.raises(ValueError, match="set num_replicas: auto"):
        ServiceConfig(num_replicas=3, autoscaling={"min_replicas": 2, "max_replicas": 3})


def test_top_shows_the_replicas_running_and_asked_for():
    from rich.console import Console

    from deploy.top import render, view

    model = (("model", "m"),)
    now = {("iterserve:num_replicas", model): 1.0, ("iterserve:num_replicas_target", model): 2.0}
    console = Console(width=160, record=True)
    console.print(render(view(now, {}, 1.0, True), "http://x"))
    assert "replicas, now: 1 running, 2 asked for" in console.export_text()
    console.print(render(view({}, {}, 1.0, True), "http://x"))  # an older server's metrics
    text = console.export_text()
    assert "replicas, now" in text and "asked for" not in text


def test_the_ingress_gives_its_counts_to_every_replica_that_answers_in_time():
    import asyncio

    from router import routing
    from router.dispatch import RayReplicas

    got: dict[str, dict] = {}
    cancelled: list[str] = []

    class Call:
        def __init__(self, signals: dict, pin: str) -> None:
            self.signals, self.pin = signals, pin

        def __await__(self):
            if self.pin == "slow":
                yield from asyncio.sleep(60).__await__()
            if self.pin == "dead":
                raise RuntimeError("replica died")
            got[self.pin] = self.signals

        def cancel(self) -> None:
            cancelled.append(self.pin)

    class Method:
        def remote(self, signals: dict, pin: str) -> Call:
            return Call(signals, pin)

    class Handle:
        app_name, deployment_name = "app-under-test", "Model"
        autoscale_signals = Method()

        def options(self, **_: object) -> Handle:
            return self

    class View:
        def replica_stats(self) -> dict[str, dict]:
            return {"a": {}, "slow": {}, "dead": {}, "b": {}}

    replicas = RayReplicas(Handle())
    signals = {"ingress_at": 1.0, "ingress_window_s": 2.0}
    assert asyncio.run(replicas.send_scaling_signals(signals, timeout_s=0.5)) == 0  # no router
    view = View()
    routing.register(view, "app-under-test", "Model")
    assert asyncio.run(replicas.send_scaling_signals(signals, timeout_s=0.5)) == 2
    assert got == {"a": signals, "b": signals} and cancelled == ["slow"]
