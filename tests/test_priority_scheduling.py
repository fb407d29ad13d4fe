"""The scheduler driven by the priority and static policies (fake runner, fake clock)."""

from __future__ import annotations

import pytest

from engine.core.request import RequestStatus
from policies import FCFSPolicy, PriorityPolicy, StaticBatchPolicy
from tests.test_scheduler import fake_step, make_request, make_scheduler


def test_high_priority_preempts_at_max_num_seqs_within_two_steps():
    sched, clock = make_scheduler(policy=PriorityPolicy(), max_num_seqs=2)
    sched.add(make_request("low0", 8, 500, 0.0, priority=2))
    sched.add(make_request("low1", 8, 500, 0.1, priority=2))
    for _ in range(5):
        fake_step(sched, clock)
    urgent = make_request("urgent", 8, 3, clock(), priority=0)
    sched.add(urgent)
    steps = 0
    while urgent.status is RequestStatus.WAITING:
        out = fake_step(sched, clock)
        steps += 1
    assert steps <= 2
    assert [r.request_id for r in out.preempted] == ["low1"]  # lowest priority, latest
    while sched.has_unfinished() and not urgent.is_finished:
        fake_step(sched, clock)
    assert urgent.is_finished


@pytest.mark.parametrize("policy,expect_first_step", [(PriorityPolicy(), 1), (None, 16)])
def test_urgent_prompt_takes_the_budget_before_a_batch_prompt_being_prefilled(
    policy, expect_first_step
):
    sched, clock = make_scheduler(
        policy=policy or FCFSPolicy(), max_num_batched_tokens=64, enable_chunked_prefill=True
    )
    sched.add(make_request("batch", 1024, 4, 0.0, priority=2))
    fake_step(sched, clock)  # the batch prompt's first 64-token chunk
    urgent = make_request("urgent", 32, 4, clock(), priority=0)
    sched.add(urgent)
    steps = 0
    while urgent.num_computed_tokens == 0:
        fake_step(sched, clock)
        steps += 1
    # Under priority the urgent prompt runs in the next step; FCFS serves the 1024-token
    # prompt first (15 more chunks), then the urgent one.
    assert steps == expect_first_step


def test_an_urgent_arrival_goes_before_every_prompt_it_outranks_not_only_the_first():
    sched, clock = make_scheduler(
        policy=PriorityPolicy(), max_num_batched_tokens=64, enable_chunked_prefill=True
    )
    sched.add(make_request("batch", 1024, 4, 0.0, priority=2))
    fake_step(sched, clock)  # the batch prompt's first 64-token chunk
    sched.add(make_request("i1", 70, 4, clock(), priority=0))
    fake_step(sched, clock)  # i1 outranks the batch prompt: its first 64 tokens
    sched.add(make_request("i2", 32, 4, clock(), priority=0))
    out = fake_step(sched, clock)
    # i1 ends its prefill (6 tokens); i2 does not outrank i1 (same class) but does outrank
    # the batch prompt, so it comes before the batch prompt's chunk. On 9df945c the batch
    # prompt took the 58 tokens left and i2 waited a step.
    assert {s.request.request_id: s.num_tokens for s in out.seqs} == {
        "i1": 6,
        "i2": 32,
        "batch": 26,
    }


def test_preempted_request_is_not_overtaken_by_same_priority_newcomers():
    sched, clock = make_scheduler(policy=PriorityPolicy(), max_num_seqs=1)
    victim = make_request("victim", 8, 50, 0.0, priority=1)
    sched.add(victim)
    for _ in range(3):
        fake_step(sched, clock)
    sched.add(make_request("urgent", 4, 2, clock(), priority=0))
    fake_step(sched, clock)
    assert victim.status is RequestStatus.WAITING and victim.num_preemptions == 1
    clock.t += 1
    newcomer = make_request("newcomer", 4, 2, clock(), priority=1)
    sched.add(newcomer)
    while not victim.is_finished:
        fake_step(sched, clock)
        assert newcomer.status is RequestStatus.WAITING or newcomer.is_finished
        if victim.status is RequestStatus.RUNNING:
            assert newcomer.status is RequestStatus.WAITING


def test_aging_lets_low_priority_finish_under_a_constant_high_priority_stream():
    sched, clock = make_scheduler(policy=PriorityPolicy(aging_s_per_level=5.0), max_num_seqs=2)
    low = make_request("low", 8, 5, 0.0, priority=2)
    sched.add(low)
    n = 0
    for _ in range(3000):
        # Two fresh high-priority requests every step keep both seats busy.
        for _ in range(2):
            sched.add(make_request(f"hi{n}", 4, 3, clock(), priority=0))
            n += 1
        fake_step(sched, clock)
        if low.is_finished:
            break
    assert low.is_finished, "aging must let the low-priority request through"

    # Control: without aging the same request starves.
    sched, clock = make_scheduler(policy=PriorityPolicy(aging_s_per_level=None), max_num_seqs=2)
    low = make_request("low", 8, 5, 0.0, priority=2)
    sched.add(low)
    for i in range(300):
        for j in range(2):
            sched.add(make_request(f"hi{i}-{j}", 4, 3, clock(), priority=0))
        fake_step(sched, clock)
    assert not low.is_finished


def test_small_requests_pass_a_head_that_lacks_kv_room_but_only_boundedly():
    # 20 blocks of 4 tokens = 80 slots. A long-running request holds 40 of them.
    policy = PriorityPolicy(max_head_of_line_skips=3)
    sched, clock = make_scheduler(policy=policy, num_blocks=20, max_num_batched_tokens=200)
    sched.add(make_request("hog", 36, 400, 0.0))
    fake_step(sched, clock)
    big = make_request("big", 60, 2, 1.0)  # needs 15 blocks for its prompt: no room yet
    sched.add(big)
    smalls = [make_request(f"s{i}", 2, 1, 2.0 + i) for i in range(6)]
    for s in smalls:
        sched.add(s)
    for _ in range(6):
        fake_step(sched, clock)
    finished_small = [s for s in smalls if s.is_finished]
    assert len(finished_small) == 3  # admitted past the blocked head, but at most 3
    assert big.status is RequestStatus.WAITING
    # Strict FCFS-like policies (0 skips) would admit none of them.
    sched0, clock0 = make_scheduler(
        policy=PriorityPolicy(max_head_of_line_skips=0), num_blocks=20, max_num_batched_tokens=200
    )
    sched0.add(make_request("hog", 36, 400, 0.0))
    fake_step(sched0, clock0)
    sched0.add(make_request("big", 60, 2, 1.0))
    small = make_request("s", 2, 1, 2.0)
    sched0.add(small)
    for _ in range(6):
        fake_step(sched0, clock0)
    assert not small.is_finished


def test_static_policy_never_admits_mid_batch():
    policy = StaticBatchPolicy(max_num_seqs=3, batch_wait_timeout_s=1.0)
    sched, clock = make_scheduler(policy=policy, max_num_seqs=3, max_num_batched_tokens=100)
    first = [make_request(f"a{i}", 4, n, 0.0) for i, n in enumerate([2, 5, 9])]
    for r in first:
        sched.add(r)
    fake_step(sched, clock)
    assert {r.request_id for r in sched.running} == {"a0", "a1", "a2"}
    late = [make_request(f"b{i}", 4, 2, clock()) for i in range(2)]
    for r in late:
        sched.add(r)
    while not all(r.is_finished for r in first):
        fake_step(sched, clock)
        # Seats free up as a0 and a1 finish, but nothing joins the running batch.
        assert all(r.status is RequestStatus.WAITING for r in late)
    for _ in range(20):
        fake_step(sched, clock)  # the partial batch starts once its wait times out
    assert all(r.is_finished for r in late)


def test_static_policy_waits_to_fill_a_batch():
    policy = StaticBatchPolicy(max_num_seqs=4, batch_wait_timeout_s=1.0)
    sched, clock = make_scheduler(policy=policy, max_num_seqs=4)
    sched.add(make_request("x", 4, 2, 0.0))
    assert sched.schedule().is_empty  # one request, no timeout yet: keep waiting
    clock.t = 1.0
    assert [s.request.request_id for s in sched.schedule().seqs] == ["x"]
