"""The simulator: the real scheduler, admission and router in virtual time."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest

from deploy.cli import main as cli_main
from deploy.config import ServiceConfig
from deploy.sim.fleet import Fleet, _prompt
from deploy.sim.report import summarize
from deploy.sim.roofline import RooflineCost
from deploy.sim.runner import SimClock, SimRunner, SimTokenizer
from deploy.sim.trace import SimRequest, TraceSpec, load_requests, parse_mix, trace_path
from engine import LLMEngine, RequestOutputKind, SamplingParams
from engine.config import EngineConfig
from engine.core.step_cost import LinearCost, StepShape, fit_linear

CLASSES = {
    "interactive": {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1},
    "batch": {"ttft_slo_s": 20.0, "tpot_slo_s": 1.0},
}


@dataclass(frozen=True)
class FixedCost:
    """``a + b * prefill tokens + c * decodes`` seconds a step, a small KV cache."""

    a: float = 0.03
    b: float = 0.001
    c: float = 0.004
    num_kv_blocks: int = 128
    max_model_len: int = 2048
    vocab_size: int = 1000

    def step_seconds(self, shape: StepShape) -> float:
        return self.a + self.b * shape.prefill_tokens + self.c * shape.decode_seqs


def trace(n: int = 40, gap: float = 0.05) -> list[SimRequest]:
    return [
        SimRequest(
            f"r{i}", i * gap, 8 + 37 * i % 200, 2 + 11 * i % 30, "interactive" if i % 3 else "batch"
        )
        for i in range(n)
    ]


def service(classes: dict = CLASSES, **kw) -> ServiceConfig:
    """One small replica without admission; ``engine`` fields over these, then ``kw``."""
    engine = {
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
        "traffic_classes": classes,
    } | kw.pop("engine", {})
    return ServiceConfig(**({"num_replicas": 1, "admission": False, "engine": engine} | kw))


def direct_steps(config: EngineConfig, cost, requests: list[SimRequest]) -> list:
    """The engine alone on a fake clock, requests added at their arrivals."""
    clock = SimClock()
    engine = LLMEngine(config, runner=SimRunner(cost, clock), tokenizer=SimTokenizer(), clock=clock)
    records: list = []
    engine.add_step_listener(records.append)
    todo = list(requests)
    while todo or engine.has_unfinished_requests():
        while todo and todo[0].arrival_s <= clock.t:
            r = todo.pop(0)
            engine.add_request(
                r.id,
                _prompt(r, cost.vocab_size),
                SamplingParams(
                    max_tokens=r.output_tokens,
                    ignore_eos=True,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                ),
                traffic_class=r.traffic_class,
                arrival_time=r.arrival_s,
            )
        if not engine.has_unfinished_requests():
            clock.t = todo[0].arrival_s
            continue
        engine.step()
    return records


def test_the_simulator_makes_the_engines_decisions_step_for_step():
    requests = trace()
    config = service()
    fleet = Fleet(config, FixedCost())
    simulated: list = []
    fleet.replicas[0].engine.add_step_listener(simulated.append)
    run = fleet.run(requests)
    direct = direct_steps(config.engine_config(), FixedCost(), requests)
    assert len(direct) > 50
    assert simulated == direct  # every step: shape, times, guard plan, preemptions
    assert all(o.status == "ok" for o in run.outcomes)
    assert run.preemptions > 0  # the small cache makes the comparison cover preemption
    bm = fleet.replicas[0].engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check()


def test_a_run_is_deterministic_and_spreads_over_replicas():
    config = service(num_replicas=3, admission=True)
    first = Fleet(config, FixedCost(), seed=7).run(trace(90, 0.02))
    second = Fleet(config, FixedCost(), seed=7).run(trace(90, 0.02))
    key = [(o.status, o.replica, o.first_token_s, o.finish_s) for o in first.outcomes]
    assert key == [(o.status, o.replica, o.first_token_s, o.finish_s) for o in second.outcomes]
    assert {o.replica for o in first.outcomes if o.status == "ok"} == {0, 1, 2}


def test_overload_is_refused_by_admission_and_no_request_is_lost():
    heavy = [SimRequest(f"r{i}", i * 0.01, 200, 20, "interactive") for i in range(120)]
    on = Fleet(service(admission=True), FixedCost()).run(heavy)
    off = Fleet(service(admission=False), FixedCost()).run(heavy)
    classes = service().traffic_classes()
    s_on, s_off = summarize(on, classes), summarize(off, classes)
    assert {o.status for o in on.outcomes} == {"ok", "refused"}
    assert all(o.status == "ok" for o in off.outcomes)
    refused = s_on["classes"]["interactive"]["refused"]
    assert 0 < refused < 120
    # What admission let in met its SLOs far more often than the unguarded queue did.
    admitted_met = s_on["classes"]["interactive"]["goodput_rps"]
    assert admitted_met > s_off["classes"]["interactive"]["goodput_rps"]


def test_a_cancelled_request_is_aborted_where_it_is_and_frees_its_blocks():
    heavy = [SimRequest(f"r{i}", i * 0.01, 200, 20, "interactive") for i in range(60)]
    fleet = Fleet(service(admission=True), FixedCost())
    # r0 runs when its client leaves; r59 is still held by admission then.
    run = fleet.run(heavy, cancels={"r0": 0.3, "r59": 0.6})
    by_id = {o.request.id: o for o in run.outcomes}
    assert by_id["r0"].status == by_id["r59"].status == "aborted"
    assert by_id["r0"].routed_s is not None and by_id["r59"].routed_s is None
    assert {o.status for o in run.outcomes} <= {"ok", "refused", "aborted"}
    engine = fleet.replicas[0].engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert fleet.admission.held == {}
    # Without the cancels, both run to the end (the cancel is what aborted them).
    plain = Fleet(service(admission=True), FixedCost()).run(heavy)
    assert {o.request.id: o.status for o in plain.outcomes}["r0"] == "ok"


def test_requests_too_long_for_a_replica_are_rejected_not_lost():
    reqs = [SimRequest("r0", 0.0, 4000, 10, "batch"), SimRequest("r1", 0.1, 10, 5, "batch")]
    run = Fleet(service(), FixedCost()).run(reqs)
    assert [o.status for o in run.outcomes] == ["rejected", "ok"]


def test_the_linear_fit_recovers_known_coefficients_and_stays_non_negative():
    truth = (0.04, 0.0015, 0.002, 0.00002, 0.0008)
    shapes = [
        StepShape(p, d, d * ctx, p * ctx + p * (p + 1) / 2, 1 if p else 0)
        for p in (0, 16, 128, 512)
        for d in (1, 4, 16)
        for ctx in (50, 400)
    ]
    seconds = [sum(t * f for t, f in zip(truth, s.features())) for s in shapes]
    fitted = fit_linear(shapes, seconds)
    assert fitted == pytest.approx(truth, rel=1e-6)
    # A feature that only lowers the error with a negative slope is held at 0.
    noisy = [t - 0.00003 * s.decode_context_tokens for t, s in zip(seconds, shapes)]
    assert min(fit_linear(shapes, noisy)) >= 0


def test_the_linear_fit_weighs_errors_relative_to_each_step():
    # One long step measured 30% slow must not pull the short decodes' fit off by as much
    # in absolute terms: the fit is judged by relative error, as the simulator is.
    truth = (0.04, 0.0015, 0.002, 0.00002, 0.0008)
    shapes = [
        StepShape(p, d, d * ctx, p * ctx + p * (p + 1) / 2, 1 if p else 0)
        for p in (0, 16, 128, 512)
        for d in (1, 4, 16)
        for ctx in (50, 400)
    ]
    seconds = [sum(t * f for t, f in zip(truth, s.features())) for s in shapes]
    longest = max(range(len(seconds)), key=seconds.__getitem__)
    seconds[longest] *= 1.3
    cost = LinearCost(fit_linear(shapes, seconds), 1000, 16, 8192, 49152)
    short = [i for i, s in enumerate(shapes) if s.prefill_tokens == 0 and s.decode_seqs == 1]
    for i in short:
        assert cost.step_seconds(shapes[i]) == pytest.approx(seconds[i], rel=0.02)
    with pytest.raises(ValueError, match="positive"):
        fit_linear(shapes, [0.0] * len(shapes))


def test_a_calibration_file_round_trips(tmp_path):
    cost = LinearCost((0.04, 0.001, 0.002, 0.0, 0.0005), 1000, 16, 8192, 49152, "test")
    cost.save(tmp_path / "c.json")
    assert LinearCost.load(tmp_path / "c.json") == cost
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="not a calibrated cost model"):
        LinearCost.load(tmp_path / "bad.json")


def test_the_roofline_is_bandwidth_bound_in_decode_and_compute_bound_in_prefill():
    h200 = RooflineCost.named("8b", "h200", step_overhead_s=0.0)
    m = h200.model
    assert m.params == pytest.approx(8.03e9, rel=0.01)
    decode = h200.step_seconds(StepShape(0, 8, 8 * 1000, 0, 0))
    weights_s = m.weight_bytes / (h200.gpu.bandwidth_bytes_s * h200.decode_efficiency)
    assert weights_s < decode < 1.2 * weights_s
    prefill = h200.step_seconds(StepShape(8192, 0, 0, 8192 * 8193 / 2, 1))
    assert prefill == pytest.approx(2 * m.matmul_params * 8192 / (989e12 * 0.6), rel=0.3)
    h100 = RooflineCost.named("8b", "h100-sxm", step_overhead_s=0.0)
    assert h100.step_seconds(StepShape(0, 8, 8000, 0, 0)) > decode  # less bandwidth
    assert h200.num_kv_blocks > RooflineCost.named("8b", "h100-sxm").num_kv_blocks > 0
    assert RooflineCost.named("70b", "h100-sxm").num_kv_blocks == 0  # weights do not fit
    assert RooflineCost.named("70b", "h100-sxm", tensor_parallel=4).num_kv_blocks > 0
    with pytest.raises(ValueError, match="unknown model"):
        RooflineCost.named("13b", "h200")


def test_each_guard_rule_can_be_switched_off_alone():
    # Batch decodes fill the replica, then interactive requests arrive: their TPOT limit
    # binds, and the guard sheds batch decodes for them.
    burst = [SimRequest(f"r{i}", 0.0, 20, 80, "batch") for i in range(24)] + [
        SimRequest(f"r{24 + i}", 1.0 + 0.05 * i, 30, 20, "interactive") for i in range(8)
    ]
    runs, acted = {}, {}
    for off in ((), ("cap",), ("shed",)):
        config = service(
            engine={
                "policy": "priority",
                "tpot_slo_guard": True,
                "max_num_seqs": 32,
                "tpot_slo_guard_rules_off": list(off),
            }
        )
        fleet = Fleet(config, FixedCost(num_kv_blocks=1024))
        steps: list = []
        fleet.replicas[0].engine.add_step_listener(steps.append)
        fleet.run(burst)
        runs[off] = steps
        acted[off] = fleet.replicas[0].engine.scheduler.guard.acted
    assert any(r.prefill_cap < math.inf for r in runs[()])
    assert all(r.prefill_cap == math.inf for r in runs[("cap",)])
    assert any(r.shed for r in runs[()]) and not any(r.shed for r in runs[("shed",)])
    # The guard counts the plans that shed: one per step that preempted for it.
    assert acted[()]["shed"] == sum(bool(r.shed) for r in runs[()]) > 0
    assert acted[("shed",)]["shed"] == 0
    with pytest.raises(ValueError):
        EngineConfig(tpot_slo_guard_rules_off=["nonsense"])


def test_traces_are_windowed_rescaled_and_classed(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"arrival_s": t, "prompt_tokens": 80, "output_tokens": 9}) + "\n"
            for t in range(10)
        )
    )
    reqs = load_requests(
        TraceSpec(
            str(path),
            window_start_s=2,
            duration_s=4,
            rate_scale=2,
            length_scale=8,
            mix=parse_mix("interactive=1,batch=1"),
        )
    )
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5]
    assert {(r.prompt_tokens, r.output_tokens) for r in reqs} == {(10, 1)}
    assert {r.traffic_class for r in reqs} <= {"interactive", "batch"}
    assert {r.prompt_key for r in reqs} == {None}
    # Lines with one prompt key share their prompt up to the shorter one's length.
    path.write_text(
        "".join(
            json.dumps({"arrival_s": 0, "prompt_tokens": n, "output_tokens": 1} | key) + "\n"
            for n, key in ((30, {"prompt_key": "sys"}), (20, {"prompt_key": "sys"}), (30, {}))
        )
    )
    shared, shorter, alone = (_prompt(r, 1000) for r in load_requests(TraceSpec(str(path))))
    assert shorter == shared[:20] and alone[:20] != shared[:20]
    path.write_text('{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_requests(TraceSpec(str(path)))
    with pytest.raises(ValueError, match="name=weight"):
        parse_mix("interactive")
    # A CSV need not be sorted (rows before the first still fall in the window); a
    # short row, a negative or fractional length and a NaN arrival are refused, not a
    # traceback or a clamp.
    csv = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"2023-11-16 18:15:0{s},10,5" for s in (5, 3, 4, 6)
    ]
    csv.write_text("\n".join(rows) + "\n")
    assert [r.arrival_s for r in load_requests(TraceSpec(str(csv)))] == [0, 1, 2, 3]
    for bad in ("2023-11-16 18:15:07,10", "2023-11-16 18:15:07,-5,5"):
        csv.write_text("\n".join([*rows, bad]) + "\n")
        with pytest.raises(ValueError, match="not an Azure trace CSV"):
            load_requests(TraceSpec(str(csv)))
    for line in (
        {"arrival_s": 0, "prompt_tokens": 10.7, "output_tokens": 5},
        {"arrival_s": 0, "prompt_tokens": "inf", "output_tokens": 5},
        {"arrival_s": "nan", "prompt_tokens": 10, "output_tokens": 5},
        {"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "prompt_key": 3},
    ):
        path.write_text(json.dumps(line) + "\n")
        with pytest.raises(ValueError, match="t.jsonl:1"):
            load_requests(TraceSpec(str(path)))


def test_the_shipped_traces_are_named_by_their_short_names(capsys):
    """``--trace conv`` reads the trace shipped as package data (a plain install has no other
    copy); an unknown name that is no file is refused in one line."""
    conv = load_requests(TraceSpec("conv", duration_s=10.0))
    code = load_requests(TraceSpec("code", duration_s=10.0))
    assert len(conv) > 10 and len(code) > 5 and conv != code
    assert conv == load_requests(TraceSpec(str(trace_path("conv")), duration_s=10.0))
    argv = ["simulate", "--trace", "conv", "--replicas", "2", "--duration", "5"]
    assert cli_main(argv) == 0
    assert "2 replica(s)" in capsys.readouterr().out
    assert cli_main(["simulate", "--trace", "nosuch", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "not a shipped trace (conv, code)" in err and "Traceback" not in err


def test_the_command_line_reports_a_sweep_and_a_search(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "arrival_s": i * 0.2,
                    "prompt_tokens": 40 + i % 50,
                    "output_tokens": 5 + i % 7,
                    "class": "interactive",
                }
            )
            + "\n"
            for i in range(60)
        )
    )
    cost = tmp_path / "cost.json"
    LinearCost((0.03, 0.001, 0.004, 0.0, 0.0), 512, 16, 2048, 1000).save(cost)
    out = tmp_path / "r.json"
    assert (
        cli_main(
            [
                "simulate",
                "--trace",
                str(path),
                "--cost-model",
                str(cost),
                "--rate-scale",
                "1,8",
                "--slo",
                "interactive=0.5,0.1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    first, second = report["runs"]
    assert first["classes"]["interactive"]["attainment"] == 1.0
    assert second["classes"]["interactive"]["attainment"] < 0.9
    assert report["goodput_rps"] == pytest.approx(first["offered_rps"])
    assert (
        cli_main(
            [
                "simulate",
                "--trace",
                str(path),
                "--cost-model",
                str(cost),
                "--rate-scale",
                "8",
                "--slo",
                "interactive=0.5,0.1",
                "--search",
                "--max-replicas",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "num_replicas:" in text and "config:\n  num_replicas:" in text
    assert f"cost model: {cost} (no source recorded)" in text  # the file the figures use


def test_the_report_names_its_cost_model_and_how_to_fit_this_host():
    from argparse import Namespace

    from deploy.sim.cli import cost_line, cost_model

    shipped = Namespace(gpu=None, model_size=None, cost_model=None, tensor_parallel=1)
    line = cost_line(shipped, cost_model(shipped))
    assert "shipped cpu_smollm2_135m.json" in line and "held-out MAPE" in line
    assert "iterserve calibrate" in line
    gpu = Namespace(gpu="h200", model_size="8b", cost_model=None, tensor_parallel=2)
    assert cost_line(gpu, cost_model(gpu)).startswith("roofline, 8b on h200 x 2")


def test_held_requests_re_decided_only_on_change_get_the_same_answers():
    heavy = [
        SimRequest(f"r{i}", i * 0.01, 100 + i % 150, 20, ("interactive", "batch")[i % 2])
        for i in range(150)
    ]
    config = service(num_replicas=2, admission=True)
    runs = []
    for fast in (True, False):
        fleet = Fleet(config, FixedCost(), seed=1)
        fleet.fast_holds = fast
        outcomes = fleet.run(heavy).outcomes
        runs.append([(o.status, o.replica, o.routed_s, o.finish_s) for o in outcomes])
    assert runs[0] == runs[1]
    assert {s for s, *_ in runs[0]} == {"ok", "refused"}
    held = [o for o in outcomes if o.routed_s is not None and o.routed_s > o.request.arrival_s]
    assert len(held) > 10  # admitted after a hold: the polls were exercised


def test_with_shed_off_admission_no_longer_holds_back_what_would_be_shed():
    # The admission gate (sheds_at_once) is the other half of shedding: with the rule off
    # nothing sheds, so a request that breaks the limit must not be held back for it.
    from types import SimpleNamespace

    from policies.priority import PriorityPolicy
    from policies.slo_guard import TpotGuard
    from policies.step_time import StepTimeModel

    def guard(off):
        return TpotGuard(
            PriorityPolicy(),
            StepTimeModel(prior=(0.04, 0.001, 0.004)),
            target=0.85,
            block_size=16,
            max_num_batched_tokens=512,
            rules_off=frozenset(off),
        )

    batch = SimpleNamespace(tpot_slo_s=5.0)
    # 43 decodes predict 0.04 + 43 * 0.004 = 0.212 s, past the 0.2 s limit.
    assert guard(()).sheds_at_once(batch, 42, 0.2)
    assert not guard(()).sheds_at_once(batch, 10, 0.2)
    assert not guard(("shed",)).sheds_at_once(batch, 42, 0.2)


def test_the_command_line_refuses_what_it_would_ignore_or_could_not_write(tmp_path, capsys):
    """Each of these is refused with one line naming the problem, exit status 2, before any
    run (not a run that fails later, nor a traceback)."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5, "class": "vip"}) + "\n"
    )
    base = ["simulate", "--trace", str(path)]
    (tmp_path / "bad.yaml").write_text("engine: [1,2\n")
    for extra, needle in [
        ([], "unknown traffic class 'vip'"),
        (["--default-class", "vip"], "unknown traffic class 'vip'"),
        (["--slo", "vip=1,0.1"], "unknown traffic class 'vip'"),
        (["--config", str(tmp_path / "bad.yaml")], "not valid YAML"),
        (["--rate-scale", "nan"], "finite number"),
        (["--json", str(tmp_path / "missing" / "r.json")], "--json"),
        (["--tensor-parallel", "2"], "goes with --gpu"),
        (["--gpu", "h200", "--model-size", "8b", "--tensor-parallel", "0"], "must be >= 1"),
        (["--search", "--ablate"], "give one"),
        (["--max-replicas", "3"], "goes with --search"),
        (["--replicas", "0"], "num_replicas: Input should be greater than or equal to 1"),
    ]:
        assert cli_main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and err.count("\n") == 1, err
    assert cli_main(["calibrate", "--output", str(tmp_path / "missing" / "c.json")]) == 2
    assert "--output" in capsys.readouterr().err  # at once, not after the sweep


def test_top_refuses_an_interval_that_would_busy_poll_or_crash(capsys):
    for interval in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            cli_main(["top", "--interval", interval])
        assert e.value.code == 2 and "must be positive" in capsys.readouterr().err


def test_a_burst_on_one_prompt_uses_both_replicas_and_meets_its_slos():
    # 16 streams with one prompt at once on two replicas. Prefix affinity alone sent them
    # all to the replica that took the first; the TPOT guard then held their decodes
    # within the SLO by starving their prefill, and the late ones missed their TTFT.
    classes = CLASSES | {"interactive": {"ttft_slo_s": 2.0, "tpot_slo_s": 0.08}}
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 256, "traffic_classes": classes}
    config = service(num_replicas=2, admission=True, engine=engine)
    cost = FixedCost(a=0.05, b=0.002, c=0.002, num_kv_blocks=1024)  # the replicas' prior fit
    burst = [SimRequest(f"r{i}", 0.0, 100, 40, "interactive", prompt_key="p") for i in range(16)]
    run = Fleet(config, cost).run(burst)
    split = sorted(sum(o.replica == i for o in run.outcomes) for i in (0, 1))
    assert split[0] >= 16 // 4, split
    missed = [o.request.id for o in run.outcomes if not (o.ttft_s <= 2.0 and o.tpot_s <= 0.08)]
    assert missed == [], split
