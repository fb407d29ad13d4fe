"""LoRA adapters in the simulator: the traces' ``model`` field, the scheduler's
``max_loras`` rule, the cost model's adapter terms, and the router's adapter affinity."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deploy.cli import main as cli_main
from deploy.config import ServiceConfig
from deploy.sim.fleet import Fleet
from deploy.sim.roofline import RooflineCost
from deploy.sim.runner import SimLoRAs
from deploy.sim.trace import SimRequest, TraceSpec, load_requests
from engine.core.params import LoRARequest
from engine.core.step_cost import LinearCost, StepShape
from tests.test_simulate import service as sim_service

CLASSES = {"interactive": {"ttft_slo_s": 5.0, "tpot_slo_s": 0.5}}
COST = LinearCost((0.02, 0.0005, 0.003, 0.0, 0.0), 256, 4, 2048, 1000, "test")
"""0.02 s a step, 0.5 ms a prefill token, 3 ms a decode; no adapter terms."""


def service(**kw) -> ServiceConfig:
    return sim_service(CLASSES, **kw)


def mixed(n: int = 24, gap: float = 0.02, models=("a", "b", None)) -> list[SimRequest]:
    return [
        SimRequest(f"r{i}", i * gap, 30 + 7 * i % 40, 4 + i % 9, "interactive", model=models[i % 3])
        for i in range(n)
    ]


def adapters_per_step(fleet: Fleet, requests: list[SimRequest]) -> list[set[str]]:
    """Each recorded step's adapters (the base model left out), replica by replica."""
    lora = {r.id: fleet.lora(r) for r in requests}
    return [
        {lora[rid].name for rid, _, _ in step.seqs if lora[rid] is not None}
        for steps in fleet.steps
        for step in steps
    ]


def key(run, fleet: Fleet) -> tuple:
    return (
        [(o.request.id, o.status, o.replica, o.first_token_s, o.finish_s) for o in run.outcomes],
        fleet.steps,
        run.busy_s,
        run.end_s,
    )


def test_a_jsonl_trace_names_adapters_by_model_and_they_run(tmp_path):
    base = service().model_name()
    lines = [
        {"arrival_s": 0.0, "prompt_tokens": 20, "output_tokens": 3, "model": "sql"},
        {"arrival_s": 0.1, "prompt_tokens": 20, "output_tokens": 3},
        {"arrival_s": 0.2, "prompt_tokens": 20, "output_tokens": 3, "model": base},
        {"arrival_s": 0.3, "prompt_tokens": 20, "output_tokens": 3, "model": "chat"},
        {"arrival_s": 0.4, "prompt_tokens": 20, "output_tokens": 3, "model": None},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    reqs = load_requests(TraceSpec(str(path), default_class="interactive"))
    assert [r.model for r in reqs] == ["sql", None, base, "chat", None]
    fleet = Fleet(service(), COST, record_steps=True)
    assert [fleet.lora(r) for r in reqs] == [
        LoRARequest("sql", "sim://sql"),
        None,
        None,  # the base model's own name
        LoRARequest("chat", "sim://chat"),
        None,
    ]
    run = fleet.run(reqs)
    assert [o.status for o in run.outcomes] == ["ok"] * 5
    assert {"sql", "chat"} <= set().union(*adapters_per_step(fleet, reqs))
    assert fleet.replicas[0].engine.load_snapshot().loras == ("sql", "chat")
    # One prompt under an adapter and under the base model: two prefixes to the router.
    shared = [
        dataclasses.replace(reqs[0], prompt_key="p"),
        dataclasses.replace(reqs[1], prompt_key="p"),
    ]
    a, b = (Fleet(service(), COST)._shape(r) for r in shared)
    assert a.prefix_hashes and a.prefix_hashes != b.prefix_hashes
    for bad in (3, "", ["a"]):
        path.write_text(json.dumps(lines[0] | {"model": bad}) + "\n")
        with pytest.raises(ValueError, match="t.jsonl:1"):
            load_requests(TraceSpec(str(path)))


def test_with_one_slot_two_adapters_never_share_a_step():
    reqs = mixed()
    one = Fleet(service(engine={"max_loras": 1}), COST, record_steps=True)
    run = one.run(reqs)
    assert all(o.status == "ok" for o in run.outcomes)
    per_step = adapters_per_step(one, reqs)
    assert max(len(s) for s in per_step) == 1
    assert {"a", "b"} == set().union(*per_step)
    # Base requests still share steps with an adapter's.
    lora = {r.id: r.model for r in reqs}
    assert any(
        {lora[rid] for rid, _, _ in s.seqs} >= {None, "a"}
        or {lora[rid] for rid, _, _ in s.seqs} >= {None, "b"}
        for s in one.steps[0]
    )
    # With two slots they do share steps: the limit is what kept them apart.
    two = Fleet(service(engine={"max_loras": 2}), COST, record_steps=True)
    two.run(reqs)
    assert max(len(s) for s in adapters_per_step(two, reqs)) == 2


def test_the_adapter_terms_price_a_step_and_are_zero_by_default(tmp_path):
    shape = StepShape(20, 3, 300, 210.0, 1, adapters=2)
    assert shape.tokens == 23
    assert COST.step_seconds(shape) == COST.step_seconds(dataclasses.replace(shape, adapters=0))
    priced = dataclasses.replace(COST, lora_token_s=1e-4, lora_step_s=0.005, lora_adapter_s=0.002)
    assert priced.step_seconds(shape) == pytest.approx(
        COST.step_seconds(shape) + 2 * (0.002 + 1e-4 * 23) + 0.005
    )
    base_shape = dataclasses.replace(shape, adapters=0)
    assert priced.step_seconds(base_shape) == COST.step_seconds(base_shape)
    gpu = RooflineCost.named("8b", "h200")
    gpu_priced = dataclasses.replace(gpu, lora_token_s=1e-6, lora_step_s=0.001)
    assert gpu.step_seconds(shape) == gpu.step_seconds(base_shape)
    assert gpu_priced.step_seconds(shape) == pytest.approx(
        gpu.step_seconds(shape) + 1e-6 * 46 + 0.001
    )
    # The file keeps the terms; a file from before them reads them as 0.
    priced.save(tmp_path / "c.json")
    assert LinearCost.load(tmp_path / "c.json") == priced
    old = json.loads((tmp_path / "c.json").read_text())
    del old["lora_token_s"], old["lora_step_s"], old["lora_adapter_s"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert LinearCost.load(tmp_path / "old.json") == dataclasses.replace(COST, source="test")
    (tmp_path / "bad.json").write_text(json.dumps(old | {"lora_step_s": -1}))
    with pytest.raises(ValueError, match="bad.json: lora_step_s"):
        LinearCost.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="lora_token_s"):
        dataclasses.replace(gpu, lora_token_s=float("nan"))
    with pytest.raises(ValueError, match="lora_adapter_s"):
        dataclasses.replace(COST, lora_adapter_s=-1e-3)


def test_simulated_steps_with_adapters_cost_the_terms_and_nothing_without():
    reqs = mixed()
    base = [dataclasses.replace(r, model=None) for r in reqs]
    plain = Fleet(service(), COST, record_steps=True)
    plain_run = plain.run(base)
    free = Fleet(service(), COST, record_steps=True)
    free_run = free.run(reqs)
    # Terms at 0 (4 slots: nothing waits for one): the same steps at the same times.
    assert [(s.seqs, s.start, s.seconds) for s in free.steps[0]] == [
        (s.seqs, s.start, s.seconds) for s in plain.steps[0]
    ]
    assert free_run.busy_s == plain_run.busy_s
    priced_cost = dataclasses.replace(
        COST, lora_token_s=2e-4, lora_step_s=0.01, lora_adapter_s=3e-3
    )
    priced = Fleet(service(), priced_cost, record_steps=True)
    priced_run = priced.run(reqs)
    assert priced_run.busy_s[0] > free_run.busy_s[0]
    lora = {r.id: r.model for r in reqs}
    with_adapters = 0
    for s in priced.steps[0]:
        n = len({lora[rid] for rid, _, _ in s.seqs} - {None})
        tokens = sum(t for _, _, t in s.seqs)
        shape = StepShape.of_record(s.seqs, s.num_decodes)
        extra = n * (3e-3 + 2e-4 * tokens) + 0.01 if n else 0.0
        assert s.seconds == pytest.approx(COST.step_seconds(shape) + extra)
        with_adapters += n > 0
    assert with_adapters > 0
    late = max(o.finish_s for o in priced_run.outcomes)
    assert late > max(o.finish_s for o in free_run.outcomes)


def test_a_trace_without_adapters_runs_as_before_the_adapters():
    """Naming the base model is naming none, and a runner with its adapter store runs a
    base-only trace exactly as a runner without one (the simulator before adapters)."""
    config = service(num_replicas=3, admission=True)
    reqs = [dataclasses.replace(r, model=None) for r in mixed(90, 0.01)]
    now = Fleet(config, COST, seed=5, record_steps=True)
    now_run = now.run(reqs)
    before = Fleet(config, COST, seed=5, record_steps=True)
    for r in before.replicas:
        r.engine.runner.lora = None
    before_run = before.run(reqs)
    assert key(now_run, now) == key(before_run, before)
    assert {o.replica for o in now_run.outcomes if o.status == "ok"} == {0, 1, 2}
    named = [dataclasses.replace(r, model=config.model_name()) for r in reqs]
    again = Fleet(config, COST, seed=5, record_steps=True)
    assert key(again.run(named), again) == key(now_run, now)


def test_the_router_sends_an_adapter_to_the_replica_that_holds_it():
    # One request warms a replica, then a burst of six arrives at once on two replicas.
    # For the base model the burst alternates between them (the requests routed since the
    # last snapshot count as load); for an adapter, the replica that holds it (its
    # snapshot's loras) takes the first three, until its queue outweighs the other's read.
    def burst(model: str | None) -> tuple[list[bool], Fleet]:
        reqs = [SimRequest("w", 0.0, 20, 3, "interactive", model=model)] + [
            SimRequest(f"b{i}", 1.0, 20, 3, "interactive", model=model) for i in range(6)
        ]
        fleet = Fleet(service(num_replicas=2, admission=True), COST, seed=seed)
        run = fleet.run(reqs)
        assert all(o.status == "ok" for o in run.outcomes)
        warm = run.outcomes[0].replica
        return [o.replica == warm for o in run.outcomes[1:]], fleet

    for seed in range(4):
        held, fleet = burst("sql")
        assert held[:3] == [True, True, True] and sum(held) >= 4, (seed, held)
        assert sorted(r.snap.loras for r in fleet.replicas) == [(), ("sql",)]
        base, _ = burst(None)
        assert sum(base) == 3, (seed, base)


def test_the_adapter_store_keeps_the_most_recent_without_files():
    store = SimLoRAs(max_loras=2, max_cpu_loras=3)
    keys = {n: store.get(LoRARequest(n, f"sim://{n}")).key for n in "abcd"}
    assert store.loaded() == ["b", "c", "d"] and store.num_loads == 4
    assert len(set(keys.values())) == 4
    store.get(LoRARequest("b", "sim://b"))
    assert store.loaded() == ["c", "d", "b"] and store.num_loads == 4
    store.prepare([LoRARequest("c", "sim://c"), None, LoRARequest("c", "sim://c")])
    assert store.loaded() == ["d", "b", "c"]
    with pytest.raises(RuntimeError, match="max_loras 2"):
        store.prepare([LoRARequest(n, f"sim://{n}") for n in "abc"])
    assert store.remove("d") and not store.remove("d")
    assert store.mean_load_s == 0.0
    assert SimLoRAs(max_loras=4).max_cpu_loras == 4


def test_the_command_line_takes_adapter_terms(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "arrival_s": i * 0.2,
                    "prompt_tokens": 30,
                    "output_tokens": 4,
                    "class": "interactive",
                    "model": ("a", "b")[i % 2],
                }
            )
            + "\n"
            for i in range(12)
        )
    )
    cost = tmp_path / "cost.json"
    COST.save(cost)
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(path), "--cost-model", str(cost), "--json", str(out)]
    flags = ["--lora-token-s", "0.0001", "--lora-step-s", "0.002", "--lora-adapter-s", "0.003"]
    assert cli_main([*argv, *flags]) == 0
    assert (
        "LoRA adapters 0.003 s per adapter + 0.0001 s per token per adapter + 0.002 s per step"
        in capsys.readouterr().out
    )
    report = json.loads(out.read_text())
    assert report["cost_model"]["lora_token_s"] == 0.0001
    assert report["cost_model"]["lora_step_s"] == 0.002
    assert report["cost_model"]["lora_adapter_s"] == 0.003
    assert report["runs"][0]["classes"]["interactive"]["refused"] == 0
    assert cli_main([*argv, "--lora-step-s", "-1"]) == 2
    assert "lora_step_s" in capsys.readouterr().err
    log = tmp_path / "steps.jsonl"
    log.write_text("")
    assert cli_main(["simulate", "--replay-steps", str(log), "--lora-token-s", "0.001"]) == 2
    assert "--lora-step-s and --lora-adapter-s do not apply" in capsys.readouterr().err
