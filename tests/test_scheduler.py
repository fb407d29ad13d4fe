"""Scheduler unit tests with a fake runner and a fake clock (no model)."""

from __future__ import annotations

import random
import zlib

from engine.config import EngineConfig
from engine.core.kv_cache import BlockManager
from engine.core.params import SamplingParams
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.schedule_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from policies import FCFSPolicy


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(num_blocks=1000, block_size=4, policy=None, **cfg):
    """A scheduler over ``num_blocks`` KV blocks on a fake clock (FCFS unless ``policy``)."""
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **cfg)
    clock = FakeClock()
    sched = Scheduler(config, BlockManager(num_blocks, block_size), policy or FCFSPolicy(), clock)
    return sched, clock


def distinct_prompt(rid: str, prompt_len: int) -> list[int]:
    """Token ids no other request id shares, so that no prefix is cached across
    requests in tests about scheduling alone."""
    base = zlib.crc32(rid.encode()) * 10_000
    return list(range(base, base + prompt_len))


def make_request(rid, prompt_len, max_tokens, arrival, priority=0, cls="standard"):
    return Request(
        rid,
        distinct_prompt(rid, prompt_len),
        SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival,
        max_tokens=max_tokens,
        priority=priority,
        traffic_class=cls,
    )


def fake_step(sched: Scheduler, clock: FakeClock) -> SchedulerOutput:
    """What the engine does with a model: sample token 7 wherever a chunk completes."""
    out = sched.schedule()
    sampled = {s.request.request_id: 7 for s in out.seqs if s.samples}
    for req in sched.update(out, sampled):
        if len(req.output_token_ids) >= req.max_tokens:
            sched.finish(req, FinishReason.LENGTH, clock())
    clock.t += 0.1
    sched.block_manager.check()
    return out


def test_budget_and_max_num_seqs_never_exceeded():
    rng = random.Random(0)
    sched, clock = make_scheduler(num_blocks=200, max_num_batched_tokens=48, max_num_seqs=6)
    for i in range(40):
        sched.add(make_request(f"r{i}", rng.randint(1, 150), rng.randint(1, 30), clock()))
    steps = 0
    while sched.has_unfinished():
        out = fake_step(sched, clock)
        assert out.num_batched_tokens <= 48
        assert len(out.seqs) <= 6 and len(sched.running) <= 6
        steps += 1
        assert steps < 10_000
    assert sched.block_manager.num_free_blocks == 200


def test_every_running_request_decodes_each_step():
    sched, clock = make_scheduler(max_num_batched_tokens=64, max_num_seqs=16)
    for i in range(10):
        sched.add(make_request(f"r{i}", 5, 50, clock()))
    fake_step(sched, clock)  # all ten prefill in one step
    for _ in range(20):
        decoding = {r.request_id for r in sched.running if r.num_pending_tokens == 1}
        out = fake_step(sched, clock)
        assert decoding == {s.request.request_id for s in out.seqs[: out.num_decodes]}
        assert len(decoding) == 10
    # With a budget below the number of running requests, the budget wins.
    sched2, clock2 = make_scheduler(max_num_batched_tokens=4, max_num_seqs=16)
    for i in range(10):
        sched2.add(make_request(f"r{i}", 1, 50, clock2()))
    for _ in range(3):
        fake_step(sched2, clock2)
    out = sched2.schedule()
    assert out.num_batched_tokens == 4


def test_long_prompt_is_chunked_while_decodes_advance():
    sched, clock = make_scheduler(max_num_batched_tokens=32, max_num_seqs=8)
    for i in range(3):
        sched.add(make_request(f"short{i}", 4, 100, clock()))
    fake_step(sched, clock)
    long_req = make_request("long", 200, 5, clock())
    sched.add(long_req)
    chunks = []
    while long_req.num_computed_tokens < 200:
        before = {r.request_id: len(r.output_token_ids) for r in sched.running}
        out = fake_step(sched, clock)
        chunk = [s.num_tokens for s in out.seqs if s.request is long_req]
        chunks += chunk
        # Every short request gained one token in this step: decodes never stall.
        for i in range(3):
            req = next(r for r in sched.running if r.request_id == f"short{i}")
            assert len(req.output_token_ids) == before[f"short{i}"] + 1
    assert sum(chunks) == 200 and len(chunks) > 1
    assert max(chunks) <= 32 - 3  # the decodes took their share of the budget first


def test_long_prefill_token_threshold_caps_a_chunk():
    sched, clock = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=10)
    req = make_request("a", 35, 1, clock())
    sched.add(req)
    sizes = [fake_step(sched, clock).seqs[0].num_tokens for _ in range(4)]
    assert sizes == [10, 10, 10, 5]


def test_no_chunking_when_disabled():
    sched, clock = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add(make_request("big", 20, 1, clock()))
    assert sched.schedule().is_empty  # it can never fit one step's budget whole
    sched2, clock2 = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched2.add(make_request("ok", 16, 1, clock2()))
    assert sched2.schedule().seqs[0].num_tokens == 16


def test_preemption_picks_latest_arrival_and_recomputes():
    # 6 blocks of 4 tokens = 24 token slots; two requests growing to 20 tokens each.
    sched, clock = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    first = make_request("first", 8, 12, 0.0)
    second = make_request("second", 8, 12, 1.0)
    sched.add(first)
    sched.add(second)
    preempted = []
    while sched.has_unfinished():
        out = fake_step(sched, clock)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"second"}
    assert first.num_preemptions == 0 and second.num_preemptions >= 1
    assert len(second.output_token_ids) == 12 and second.status is RequestStatus.FINISHED
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_request_keeps_its_arrival_order():
    sched, clock = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    sched.add(make_request("a", 8, 12, 0.0))
    b = make_request("b", 8, 12, 1.0)
    sched.add(b)
    while b.num_preemptions == 0:
        fake_step(sched, clock)
    late = make_request("late", 4, 2, 10.0)
    sched.add(late)
    assert sched.policy.order(sched.waiting, clock())[0] is b
