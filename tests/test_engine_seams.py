"""The engine with a fake runner and a fake clock: no model, no wall clock.

A run is then a pure function of its requests, which is what the simulator needs: the same
requests give the same steps, token for token and second for second.
"""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams, StepRecord
from engine.core.interfaces import SampleResult

EOS = 0
VOCAB = 1000


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == EOS))


class CostModelRunner:
    """Advances the clock by ``a + b * prefill tokens + c * decodes`` per step and
    samples a token that depends only on the sequence's prompt length and position."""

    num_kv_blocks = 256
    max_model_len = 2048
    vocab_size = VOCAB
    eos_token_ids = frozenset({EOS})

    def __init__(self, clock: FakeClock, a=0.03, b=0.002, c=0.004) -> None:
        self.clock, self.a, self.b, self.c = clock, a, b, c
        self.steps = 0

    def execute(self, out):
        prefill = out.num_batched_tokens - out.num_decodes
        self.clock.t += self.a + self.b * prefill + self.c * out.num_decodes
        self.steps += 1
        return {
            s.request.request_id: SampleResult(
                1 + (len(s.request.prompt_token_ids) * 31 + s.request.num_tokens) % 997,
                {EOS: -1.0} if s.request.params.logprobs is not None else None,
            )
            for s in out.seqs
            if s.samples
        }


def fake_engine(runner_cls: type[CostModelRunner] | None = None, **config) -> LLMEngine:
    """An engine on a fake clock, a cost-model runner (``runner_cls``, default
    :class:`CostModelRunner`) and the fake tokenizer; ``config``: more ``EngineConfig`` fields
    beside ``block_size=4``."""
    clock = FakeClock()
    runner = (runner_cls or CostModelRunner)(clock)
    return LLMEngine(
        EngineConfig(block_size=4, **config), runner=runner, tokenizer=FakeTokenizer(), clock=clock
    )


def run(policy: str, guard: bool) -> tuple[list[StepRecord], dict[str, list[int]], float]:
    """A burst of requests of two classes with staggered arrivals, to completion."""
    clock = FakeClock()
    classes = {"interactive": {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1}}
    config = EngineConfig(
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        policy=policy,
        tpot_slo_guard=guard,
        traffic_classes=classes,
    )
    runner = CostModelRunner(clock)
    engine = LLMEngine(config, runner=runner, tokenizer=FakeTokenizer(), clock=clock)
    records: list[StepRecord] = []
    engine.add_step_listener(records.append)
    tokens: dict[str, list[int]] = {}
    arrivals = [
        (
            0.02 * i,
            f"r{i}",
            5 + 7 * i % 40,
            3 + 5 * i % 17,
            "interactive" if i % 3 == 0 else "batch",
        )
        for i in range(24)
    ]
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= clock.t:
            at, rid, plen, out_len, cls = arrivals.pop(0)
            params = SamplingParams(
                max_tokens=out_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            engine.add_request(
                rid, list(range(1, plen + 1)), params, traffic_class=cls, arrival_time=at
            )
        if not engine.has_unfinished_requests():
            clock.t = arrivals[0][0]
            continue
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return records, tokens, clock.t


def test_a_fake_clock_and_runner_reproduce_the_schedule_step_for_step():
    for policy, guard in (("fcfs", False), ("priority", True)):
        first, second = run(policy, guard), run(policy, guard)
        records, tokens, end = first
        assert len(records) > 20 and len(tokens) == 24
        assert first == second  # every step: shape, times, plan; every token
        # Times come from the injected clock alone: each step lasts what the cost model says.
        r = records[5]
        for r in records:
            cost = 0.03 + 0.002 * r.num_prefill_tokens + 0.004 * r.num_decodes
            assert r.seconds == pytest.approx(cost)
        assert end == pytest.approx(records[-1].start + records[-1].seconds)
        # Scheduling takes no fake time, and a runner without last_phases gives no phases.
        assert all(r.schedule_s == 0.0 and r.phases == () for r in records)


def test_the_runners_own_phases_reach_the_step_record():
    class PhasedRunner(CostModelRunner):
        def execute(self, out):
            self.last_phases = (("forward", 0.5 + self.steps),)
            return super().execute(out)

    engine = fake_engine(PhasedRunner)
    records: list[StepRecord] = []
    engine.add_step_listener(records.append)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.phases for r in records] == [
        (("forward", 0.5),),
        (("forward", 1.5),),
        (("forward", 2.5),),
    ]


def test_step_listeners_each_get_every_record_in_the_order_added():
    engine = fake_engine()
    calls: list[tuple[str, int]] = []
    engine.add_step_listener(lambda r: calls.append(("a", r.index)))
    engine.add_step_listener(lambda r: calls.append(("b", r.index)))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_a_step_listener_that_raises_ends_the_step_with_its_error():
    engine = fake_engine()
    after: list[StepRecord] = []

    def broken(r: StepRecord) -> None:
        raise RuntimeError("listener")

    engine.add_step_listener(broken)
    engine.add_step_listener(after.append)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(RuntimeError, match="listener"):
        engine.step()
    # The step itself ran (its token is the request's); the later listener missed it.
    assert after == [] and engine.has_unfinished_requests()
    engine.step_listeners.remove(broken)
    engine.step()
    assert [r.index for r in after] == [1] and not engine.has_unfinished_requests()


def test_while_a_step_runs_the_published_load_is_as_after_it():
    engine = fake_engine(max_num_batched_tokens=64)
    seen = []
    engine.on_scheduled = seen.append
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("long", list(range(1, 101)), params)  # 100 tokens: two chunks
    engine.add_request("short", list(range(1, 11)), params)
    before = engine.load_snapshot()
    assert before.waiting_prefill_tokens == {"standard": 110} and before.step_left_s == 0
    engine.step()
    # The first step prefills 64 of the long prompt: 36 tokens of it and the short prompt
    # are left after it, and the step's predicted time is what remains of it.
    first = seen[0]
    assert first.waiting_prefill_tokens == {"standard": 46}
    assert first.running_seqs == {"standard": 1}
    assert first.step_left_s == pytest.approx(engine.step_time_model.predict(64, 0))
    assert engine.load_snapshot().step_left_s == 0  # after the step: none in flight
    engine.step()
    # The second ends both prefills (36 + 10 tokens): nothing is left to prefill.
    assert seen[1].waiting_prefill_tokens == {} and seen[1].running_seqs == {"standard": 2}


def test_the_guard_is_switched_on_by_config_and_shapes_the_steps():
    off, _, _ = run("priority", False)
    on, _, _ = run("priority", True)
    assert all(r.prefill_cap == float("inf") for r in off)
    assert any(r.prefill_cap < 64 for r in on)
    assert [r.seqs for r in on] != [r.seqs for r in off]


def test_delta_and_final_only_outputs_carry_what_their_kind_says():
    engine = fake_engine()
    kinds = {
        "d": RequestOutputKind.DELTA,
        "f": RequestOutputKind.FINAL_ONLY,
        "c": RequestOutputKind.CUMULATIVE,
    }
    for rid, kind in kinds.items():
        engine.add_request(
            rid,
            [1, 2, 3],
            SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0, output_kind=kind),
        )
    seen: dict[str, list] = {rid: [] for rid in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [len(o.outputs[0].token_ids) for o in seen["d"]] == [1, 1, 1, 1]
    assert [len(o.outputs[0].token_ids) for o in seen["c"]] == [1, 2, 3, 4]
    assert len(seen["f"]) == 1 and seen["f"][0].finished
    whole = seen["c"][-1].outputs[0]
    assert seen["f"][0].outputs[0].token_ids == whole.token_ids
    assert sum((o.outputs[0].token_ids for o in seen["d"]), []) == whole.token_ids
    assert "".join(o.outputs[0].text for o in seen["d"]) == whole.text
    assert [len(o.outputs[0].logprobs) for o in seen["d"]] == [1, 1, 1, 1]
