"""Scheduling policies on small stand-in requests and a simulated clock (pure Python)."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from policies import (
    DEFAULT_CLASSES,
    POLICIES,
    FCFSPolicy,
    PriorityPolicy,
    StaticBatchPolicy,
    TrafficClass,
    make_classes,
    make_policy,
)


@dataclass(eq=False)
class Req:
    request_id: str
    arrival_time: float
    priority: int = 1
    traffic_class: str = "standard"


def ids(requests):
    return [r.request_id for r in requests]


# -- priority: order and aging -----------------------------------------------------------


def test_priority_orders_by_priority_then_arrival():
    policy = PriorityPolicy(aging_s_per_level=None)
    reqs = [
        Req("b2", 1.0, 2),
        Req("s1", 2.0, 1),
        Req("i1", 3.0, 0),
        Req("s0", 0.5, 1),
        Req("i0", 2.5, 0),
    ]
    random.Random(0).shuffle(reqs)
    assert ids(policy.order(reqs, now=3.0)) == ["i0", "i1", "s0", "s1", "b2"]


def test_aging_lets_a_waiting_low_priority_request_overtake_fresh_urgent_ones():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    low = Req("low", 0.0, priority=2)
    # At 5 s the low request has gained half a level: fresh urgent requests go first.
    assert ids(policy.order([low, Req("hi", 5.0, 0)], now=5.0)) == ["hi", "low"]
    assert policy.effective_priority(low, 5.0) == pytest.approx(1.5)
    # At 25 s it has gained 2.5 levels: ahead of a fresh priority-0 request.
    assert ids(policy.order([Req("hi", 25.0, 0), low], now=25.0)) == ["low", "hi"]
    # Without aging it never does.
    strict = PriorityPolicy(aging_s_per_level=None)
    assert ids(strict.order([Req("hi", 1000.0, 0), low], now=1000.0)) == ["hi", "low"]
    assert ids(PriorityPolicy(float("inf")).order([Req("hi", 99.0, 0), low], 99.0)) == ["hi", "low"]


def _serve_under_a_stream(policy, horizon_s, dt=0.25):
    """One priority-0 request arrives per step and the head of the order is served; a
    backlog of 50 keeps the queue full. Returns (time the low request was served or None,
    its rank at each step)."""
    low = Req("low", 0.0, priority=2)
    waiting = [low, *(Req(f"b{i}", 0.0, 0) for i in range(50))]
    ranks = []
    t, k = 0.0, 0
    while t <= horizon_s:
        waiting.append(Req(f"h{k}", t, 0))
        order = policy.order(waiting, t)
        ranks.append((t, ids(order).index("low")))
        if order[0] is low:
            return t, ranks
        waiting.remove(order[0])
        k += 1
        t = k * dt
    return None, ranks


def test_aging_bounds_the_wait_of_low_priority_under_a_constant_urgent_stream():
    served_at, ranks = _serve_under_a_stream(PriorityPolicy(aging_s_per_level=10.0), 200.0)
    # Ahead of it stay only requests that arrived before 0 + 2 levels * 10 s = 20 s:
    # the 50 of the backlog and 80 of the stream, one served per 0.25 s step.
    assert served_at is not None and served_at <= (50 + 80) * 0.25
    # From 20 s on, no newcomer overtakes it: its rank only falls.
    later = [rank for t, rank in ranks if t >= 20.0]
    assert all(b <= a for a, b in zip(later, later[1:]))
    # Strict priorities starve it.
    served_strict, _ = _serve_under_a_stream(PriorityPolicy(aging_s_per_level=None), 200.0)
    assert served_strict is None


def test_a_backlog_whose_level_is_being_served_does_not_age_past_urgent_arrivals():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    backlog = [Req(f"b{i}", 0.1 * i, priority=2) for i in range(10)]
    # Batch requests keep being admitted (batch traffic above capacity, say) ...
    for t in (5.0, 15.0, 30.0, 45.0):
        policy.on_admit(Req(f"served{t}", t - 1.0, priority=2), t)
    # ... so at 50 s the 50-second-old backlog has gained only (50 - 45) / 10 levels:
    # a fresh interactive request goes first.
    order = ids(policy.order([*backlog, Req("i", 50.0, 0)], now=50.0))
    assert order[0] == "i" and order[1:] == [f"b{i}" for i in range(10)]
    assert policy.preempts(Req("i", 50.0, 0), Req("b_running", 0.0, 2), now=50.0)
    # Once its level goes unserved for two levels' worth, the backlog's head overtakes.
    order = ids(policy.order([*backlog, Req("i", 66.0, 0)], now=66.0))
    assert order[0] == "b0"
    # Plain arrival-time aging would have put the whole backlog first at 50 s.
    fresh = PriorityPolicy(aging_s_per_level=10.0)
    assert ids(fresh.order([*backlog, Req("i", 50.0, 0)], now=50.0))[-1] == "i"


def test_an_admitted_request_keeps_its_deadline_after_its_level_is_served_again():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    aged = Req("aged", 0.0, priority=2)
    policy.on_admit(aged, 25.0)  # aged past fresh urgent work: deadline 20 s
    policy.on_admit(Req("later", 24.0, priority=2), 26.0)
    fresh = Req("i", 27.0, 0)
    assert not policy.preempts(fresh, aged, now=27.0)  # no thrash: it keeps its place
    assert ids(policy.order([fresh, aged], now=27.0)) == ["aged", "i"]
    policy.on_finish(aged)
    assert policy.effective_priority(Req("aged", 0.0, 2), 27.0) == pytest.approx(2 - 0.1)


def test_outranks_is_raw_priority_and_does_not_age():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    old = Req("old", 0.0, priority=0)
    policy.on_admit(old, 0.0)
    fresh = Req("fresh", 15.0, priority=0)
    # 15 s on, the old request has aged a level and more past a fresh one of its class ...
    assert policy.preempts(old, fresh, now=15.0)
    # ... but its SLO does not come before the fresh one's: only a lower class yields.
    assert not policy.outranks(old, fresh)
    assert policy.outranks(old, Req("b", 0.0, priority=2))
    assert not policy.outranks(Req("b", 0.0, priority=2), fresh)


def test_priority_orders_running_requests_with_the_same_key():
    policy = PriorityPolicy()
    running = [Req("b", 0.0, 2), Req("i", 1.0, 0), Req("s", 0.5, 1)]
    assert ids(policy.order(running, now=2.0)) == ["i", "s", "b"]


# -- priority: victims and preemption ------------------------------------------------------


def test_pick_victim_is_lowest_priority_then_latest_arrival():
    policy = PriorityPolicy()
    running = [Req("i", 9.0, 0), Req("b_old", 1.0, 2), Req("b_new", 5.0, 2), Req("s", 8.0, 1)]
    for seed in range(5):
        random.Random(seed).shuffle(running)
        assert policy.pick_victim(running).request_id == "b_new"
    # Raw priority, not aged: a long-waiting batch request is still the victim.
    assert policy.pick_victim([Req("b", -100.0, 2), Req("s", 0.0, 1)]).request_id == "b"


def test_preempts_only_for_strictly_more_urgent():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    now = 1.0
    running = Req("r", 0.5, 1)
    assert policy.preempts(Req("w", 1.0, 0), running, now)
    assert not policy.preempts(Req("w", 1.0, 1), running, now)  # same class
    assert not policy.preempts(Req("w", 1.0, 2), running, now)  # less urgent
    strict = PriorityPolicy(aging_s_per_level=None)
    assert strict.preempts(Req("w", 1.0, 0), Req("r", 0.0, 2), now)
    assert not strict.preempts(Req("w", 0.0, 1), Req("r", 0.9, 1), now)


def test_aging_preempts_only_after_a_whole_level_and_never_back():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    old = Req("old", 0.0, 1)  # admitted late, e.g. overtaken while it lacked KV room
    young = Req("young", 4.0, 1)
    # Half a level of aging is not enough to displace work of its own class.
    assert not policy.preempts(old, young, now=5.0)
    # A level and a half is.
    assert policy.preempts(old, young, now=15.0)
    # The victim, however long it waits afterwards, never preempts it back (no thrash).
    for now in (15.0, 30.0, 100.0, 1000.0):
        assert not policy.preempts(young, old, now)


def test_fresh_urgent_request_does_not_preempt_work_that_aged_ahead_of_it():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    batch = Req("batch", 0.0, 2)  # virtual deadline 0 + 2 * 10 = 20 s
    assert policy.preempts(Req("i", 15.0, 0), batch, now=15.0)
    assert not policy.preempts(Req("i", 25.0, 0), batch, now=25.0)


def test_preempted_request_keeps_its_place_before_same_priority_newcomers():
    policy = PriorityPolicy(aging_s_per_level=10.0)
    victim = Req("victim", 0.0, 1)
    newcomers = [Req(f"n{t}", float(t), 1) for t in (1, 2, 3, 4, 6)]
    urgent = Req("urgent", 5.0, 0)
    running = [victim]
    assert policy.pick_victim(running) is victim and policy.preempts(urgent, victim, 5.0)
    # The engine sends it back to waiting with its arrival time unchanged.
    waiting = [*newcomers, urgent, victim]
    order = ids(policy.order(waiting, now=6.0))
    assert order[:2] == ["urgent", "victim"]
    assert order[2:] == ["n1", "n2", "n3", "n4", "n6"]


def test_priority_admits_everything_and_validates():
    policy = PriorityPolicy(max_head_of_line_skips=3)
    assert policy.max_head_of_line_skips == 3
    assert policy.may_admit(Req("a", 0.0, 2), num_running=10, num_waiting=5, now=1.0)
    policy.on_finish(Req("a", 0.0))
    with pytest.raises(ValueError, match="aging_s_per_level"):
        PriorityPolicy(aging_s_per_level=0)
    with pytest.raises(ValueError, match="max_head_of_line_skips"):
        PriorityPolicy(max_head_of_line_skips=-1)


# -- traffic classes -----------------------------------------------------------------------


def test_default_classes():
    i, s, b = (DEFAULT_CLASSES[n] for n in ("interactive", "standard", "batch"))
    assert (i.default_priority, s.default_priority, b.default_priority) == (0, 1, 2)
    assert (i.ttft_slo_s, i.tpot_slo_s, i.max_queue_wait_s) == (2.0, 0.5, 1.0)
    assert (s.ttft_slo_s, s.tpot_slo_s, s.max_queue_wait_s) == (5.0, 1.0, 3.0)
    assert (b.ttft_slo_s, b.tpot_slo_s, b.max_queue_wait_s) == (60.0, 5.0, 30.0)
    assert i.rejectable and s.rejectable and not b.rejectable
    assert b.hard_queue_cap == 1000 and i.hard_queue_cap is None


def test_make_classes_overrides_and_adds():
    classes = make_classes(
        {
            "interactive": {"ttft_slo_s": 0.5},
            "bulk": {
                "ttft_slo_s": 600,
                "tpot_slo_s": 10,
                "default_priority": 3,
                "max_queue_wait_s": 60,
                "rejectable": False,
            },
        }
    )
    assert classes["interactive"].ttft_slo_s == 0.5
    assert classes["interactive"].tpot_slo_s == 0.5
    assert classes["bulk"] == TrafficClass("bulk", 600, 10, 3, 60, None, False)
    assert DEFAULT_CLASSES["interactive"].ttft_slo_s == 2.0  # untouched
    with pytest.raises(ValueError, match="unknown fields"):
        make_classes({"interactive": {"ttft": 1}})
    with pytest.raises(ValueError, match="new"):
        make_classes({"new": {"ttft_slo_s": 1}})
    with pytest.raises(ValueError, match="tpot_slo_s"):
        make_classes({"interactive": {"tpot_slo_s": 0}})


# -- static batching -----------------------------------------------------------------------


class StaticSim:
    """The scheduler's calls to a policy, without a model: each step orders the queues,
    then admits waiting requests the policy allows, at most ``admit_per_step`` (a stand-in
    for the token budget); each running request finishes after its ``steps``."""

    def __init__(self, policy, admit_per_step=100):
        self.policy = policy
        self.admit_per_step = admit_per_step
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.left: dict[str, int] = {}
        self.finished: list[str] = []

    def add(self, req, steps):
        self.waiting.append(req)
        self.left[req.request_id] = steps

    def step(self, now):
        """Returns the ids admitted in this step."""
        p = self.policy
        p.order(self.waiting, now)  # the scheduler's urgent-preemption pass
        p.order(self.running, now)
        admitted = []
        num_running = len(self.running)
        for req in p.order(self.waiting, now):
            if len(admitted) == self.admit_per_step:
                break
            if not p.may_admit(req, num_running, len(self.waiting), now):
                continue
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append(req.request_id)
        for req in list(self.running):
            self.left[req.request_id] -= 1
            if self.left[req.request_id] == 0:
                self.running.remove(req)
                self.finished.append(req.request_id)
                p.on_finish(req)
        return admitted


def test_static_waits_for_a_full_batch():
    sim = StaticSim(StaticBatchPolicy(max_num_seqs=4, batch_wait_timeout_s=0.5))
    sim.add(Req("a", 0.0), 10)
    sim.add(Req("b", 0.1), 10)
    assert sim.step(0.1) == [] and sim.step(0.2) == []
    sim.add(Req("c", 0.25), 10)
    sim.add(Req("d", 0.3), 10)
    sim.add(Req("e", 0.3), 10)
    assert sim.step(0.3) == ["a", "b", "c", "d"]  # full: no need to wait for the timeout
    assert sim.policy.batch == {"a", "b", "c", "d"}


def test_static_starts_a_partial_batch_at_the_timeout():
    sim = StaticSim(StaticBatchPolicy(max_num_seqs=4, batch_wait_timeout_s=0.5))
    sim.add(Req("a", 0.0), 3)
    sim.add(Req("b", 0.2), 3)
    assert sim.step(0.25) == [] and sim.step(0.49) == []
    assert sim.step(0.5) == ["a", "b"]  # 0.5 s after the oldest arrival


def test_static_runs_the_batch_to_completion_before_the_next():
    sim = StaticSim(StaticBatchPolicy(max_num_seqs=3, batch_wait_timeout_s=0.0))
    for rid, steps in (("a", 1), ("b", 2), ("c", 5)):
        sim.add(Req(rid, 0.0), steps)
    sim.add(Req("late0", 0.0), 2)  # over max_num_seqs: waits for the next batch
    assert sim.step(0.0) == ["a", "b", "c"]
    t = 0.0
    for rid in ("x", "y", "z", "w"):
        t += 0.1
        sim.add(Req(rid, t), 2)
        # Seats are free as a and b finish, but nothing joins the running batch.
        assert sim.step(t) == [], sim.running
    assert sim.finished == ["a", "b", "c"] and not sim.policy.batch
    # The batch ended: the next forms from the oldest three waiting.
    assert sim.step(t + 0.1) == ["late0", "x", "y"]
    assert sim.step(t + 0.2) == []  # z and w wait for that batch to end...
    assert sim.step(t + 0.3) == ["z", "w"]  # ...which it did in the step before


def test_static_admits_members_across_steps_and_only_members():
    sim = StaticSim(
        StaticBatchPolicy(max_num_seqs=4, batch_wait_timeout_s=0.5), admit_per_step=2
    )  # the token budget limits prefill
    for i in range(4):
        sim.add(Req(f"m{i}", i * 0.001), 10)
    assert sim.step(0.0) == ["m0", "m1"]
    sim.add(Req("n", 0.01), 1)
    assert sim.step(0.1) == ["m2", "m3"]
    assert sim.step(0.2) == []
    # A preempted member goes back to waiting and is re-admitted; "n" still is not.
    victim = sim.policy.pick_victim(sim.running)
    assert victim.request_id == "m3"
    sim.running.remove(victim)
    sim.waiting.append(victim)
    assert sim.step(0.3) == ["m3"]


def test_static_on_finish_of_an_aborted_waiting_request():
    policy = StaticBatchPolicy(max_num_seqs=2, batch_wait_timeout_s=1.0)
    a, b, c = Req("a", 0.0), Req("b", 0.1), Req("c", 0.2)
    policy.order([a, b, c], 0.3)
    policy.on_finish(a)  # aborted while waiting: not a member of the next batch
    assert policy.may_admit(b, 0, 2, 0.3) and policy.may_admit(c, 0, 2, 0.3)
    assert policy.batch == {"b", "c"}


def test_static_never_preempts_and_validates():
    policy = StaticBatchPolicy(max_num_seqs=2)
    assert policy.max_head_of_line_skips == 0
    assert not policy.preempts(Req("a", 0.0, 0), Req("b", 1.0, 2), 2.0)
    assert not policy.outranks(Req("a", 0.0, 0), Req("b", 1.0, 2))
    with pytest.raises(ValueError):
        StaticBatchPolicy(max_num_seqs=0)
    with pytest.raises(ValueError):
        StaticBatchPolicy(max_num_seqs=2, batch_wait_timeout_s=-1)


# -- FCFS and the registry -----------------------------------------------------------------


def test_fcfs_still_works():
    policy = FCFSPolicy()
    reqs = [Req("c", 3.0, 0), Req("a", 1.0, 2), Req("b", 2.0, 1)]
    assert ids(policy.order(reqs, 4.0)) == ["a", "b", "c"]
    assert policy.pick_victim(reqs).request_id == "c"
    assert not policy.preempts(reqs[0], reqs[1], 4.0)
    assert not policy.outranks(reqs[1], reqs[0])
    assert policy.may_admit(reqs[0], 0, 1, 4.0)
    assert policy.max_head_of_line_skips == 0


def test_registry():
    assert set(POLICIES) >= {"fcfs", "priority", "static"}
    assert isinstance(make_policy("fcfs"), FCFSPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)
    static = make_policy("static", max_num_seqs=8)
    assert isinstance(static, StaticBatchPolicy) and static.max_num_seqs == 8
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("lottery")


def test_policies_package_does_not_import_torch():
    code = (
        "import sys, policies, policies.priority, policies.static, policies.admission; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
