"""SLO-aware admission: decisions on synthetic load snapshots, and the prediction log."""

from __future__ import annotations

import json
import math

import pytest

from policies import (
    DEFAULT_CLASSES,
    AdmissionController,
    Admit,
    FCFSPolicy,
    LoadSnapshot,
    PredictionLog,
    Reject,
    Wait,
    make_classes,
)

# -- decisions ---------------------------------------------------------------------------

COEFS = (0.05, 0.002, 0.002)


def snap(waiting_tokens=None, running=None, waiting_requests=None, kv_free=100_000, **kw):
    return LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks_free=kv_free,
        waiting_prefill_tokens=waiting_tokens or {},
        running_seqs=running or {},
        waiting_requests=waiting_requests or {},
        step_coefficients=COEFS,
        **kw,
    )


def queue(cls, tokens, running=None, prompt=200):
    """A snapshot with ``tokens`` of ``cls`` prompts queued, ``prompt`` tokens each."""
    return snap({cls: tokens}, running or {}, {cls: tokens // prompt})


def test_idle_replica_admits():
    ac = AdmissionController()
    for cls, prio in (("interactive", 0), ("standard", 1), ("batch", 2)):
        assert ac.decide(snap(), cls, 200, 128, prio, 0.0) == Admit()
    # Even a prompt too long for the TTFT SLO anywhere: waiting would not help it.
    assert ac.predict(snap(), "interactive", 20_000).ttft_s > 2.0
    assert ac.decide(snap(), "interactive", 20_000, 128, 0, 0.0) == Admit()


def test_prediction_matches_the_budgeted_step_model():
    ac = AdmissionController()
    s = snap({"interactive": 1000}, {"interactive": 12}, {"interactive": 5})
    pred = ac.predict(s, "interactive", 300)
    # 1300 tokens at 512 - 12 = 500 per step: 3 steps of a + 12c, plus 1300 b.
    assert pred.steps == 3 and pred.tokens_ahead == 1000 and pred.requests_ahead == 5
    assert pred.ttft_s == pytest.approx(3 * (0.05 + 12 * 0.002) + 1300 * 0.002)
    # TPOT: the 1300 tokens amortised over 32 steps, 13 decodes.
    assert pred.tpot_s == pytest.approx(0.05 + 0.002 * 1300 / 32 + 13 * 0.002)


def test_interactive_behind_a_huge_interactive_queue_waits_then_is_rejected():
    ac = AdmissionController()
    s = queue("interactive", 20_000, {"interactive": 8})
    first = ac.decide(s, "interactive", 200, 128, 0, waited_s=0.0)
    assert isinstance(first, Wait) and first.max_wait_s == pytest.approx(1.0)
    assert "TTFT" in first.reason
    later = ac.decide(s, "interactive", 200, 128, 0, waited_s=0.4)
    assert isinstance(later, Wait) and later.max_wait_s == pytest.approx(0.6)
    final = ac.decide(s, "interactive", 200, 128, 0, waited_s=1.0)
    assert isinstance(final, Reject)
    assert final.retry_after_s >= 1 and final.retry_after_s == int(final.retry_after_s)


def test_retry_after_grows_with_the_queue_and_is_at_least_one_second():
    ac = AdmissionController()
    retries = []
    for tokens in (1_000, 3_000, 10_000, 30_000, 100_000):
        d = ac.decide(queue("interactive", tokens), "interactive", 200, 128, 0, 5.0)
        assert isinstance(d, Reject)
        retries.append(d.retry_after_s)
    assert all(r >= 1 for r in retries)
    assert retries == sorted(retries) and retries[-1] > 10 * retries[1] > 0


def test_retry_after_is_long_enough_for_the_queue_to_drain():
    ac = AdmissionController()
    tokens, d = 30_000, 8
    s = queue("interactive", tokens, {"interactive": d})
    retry = ac.decide(s, "interactive", 200, 128, 0, 5.0).retry_after_s
    # The queue drains at (budget - d) tokens per step of a + b (budget - d) + c d s.
    per_step = 512 - d
    drained = int(retry / (COEFS[0] + COEFS[1] * per_step + COEFS[2] * d)) * per_step
    later = queue("interactive", max(0, tokens - drained), {"interactive": d})
    assert ac.decide(later, "interactive", 200, 128, 0, 0.0) == Admit()
    # And not wildly longer: two seconds less would not have been enough.
    drained = int((retry - 2) / (COEFS[0] + COEFS[1] * per_step + COEFS[2] * d)) * per_step
    earlier = queue("interactive", tokens - drained, {"interactive": d})
    assert ac.decide(earlier, "interactive", 200, 128, 0, 0.0) != Admit()


def test_waited_time_counts_against_the_ttft_slo():
    ac = AdmissionController()
    s = queue("interactive", 500)  # TTFT ~1.45 s: fits 2 s fresh, not after 0.9 s
    assert ac.decide(s, "interactive", 200, 128, 0, 0.0) == Admit()
    assert isinstance(ac.decide(s, "interactive", 200, 128, 0, 0.9), Wait)


def test_a_held_request_is_refused_once_its_ttft_slo_is_out_of_reach():
    # The SLOs the peers benchmark declares: a 2 s TTFT, shorter than the 3 s hold.
    classes = make_classes({"standard": {"ttft_slo_s": 2.0, "tpot_slo_s": 5.0}})
    ac = AdmissionController(classes)
    a, b, _ = COEFS
    s = queue("standard", 20_000)  # far too much ahead: held
    idle = a + 200 * b  # what an idle replica would take for its 200 tokens
    # Held while an idle replica could still serve it within the margin of what is left...
    assert isinstance(ac.decide(s, "standard", 200, 16, 1, 2.0 - idle / 0.85 - 0.05), Wait)
    # ...refused at once past that point, not at the end of its 3 s max_queue_wait_s.
    lost = 2.0 - idle / 0.85 + 0.05
    assert lost < classes["standard"].max_queue_wait_s
    refused = ac.decide(s, "standard", 200, 16, 1, lost)
    assert isinstance(refused, Reject) and refused.kind == "ttft"  # the metrics' label
    # A prompt out of reach even on arrival is not lost by waiting: it keeps its hold.
    assert isinstance(ac.decide(s, "standard", 2_000, 16, 1, lost), Wait)
    # The batch class is never refused for its SLO.
    assert isinstance(ac.decide(s, "batch", 200, 16, 2, 100.0), Wait)


def test_predictions_must_fit_the_slo_margin():
    s = queue("interactive", 650)  # 850 tokens: 2 steps, TTFT 0.1 + 1.7 = 1.8 s
    assert AdmissionController(slo_margin=1.0).decide(s, "interactive", 200, 16, 0, 0.0) == Admit()
    d = AdmissionController(slo_margin=0.85).decide(s, "interactive", 200, 16, 0, 0.0)
    assert isinstance(d, Wait) and "1.80 s > 1.70 s" in d.reason
    with pytest.raises(ValueError, match="slo_margin"):
        AdmissionController(slo_margin=0.0)


def test_batch_under_the_same_load_waits_and_is_rejected_only_at_its_queue_cap():
    ac = AdmissionController()
    cap = DEFAULT_CLASSES["batch"].hard_queue_cap
    heavy = snap(
        {"interactive": 20_000, "batch": 400_000},
        {"interactive": 8},
        {"interactive": 100, "batch": cap - 1},
    )
    for waited in (0.0, 10.0, 30.0, 300.0, 3000.0):
        d = ac.decide(heavy, "batch", 200, 128, 2, waited)
        assert isinstance(d, Wait), (waited, d)
        assert 0 < d.max_wait_s <= DEFAULT_CLASSES["batch"].max_queue_wait_s
    at_cap = snap(
        {"interactive": 20_000, "batch": 400_000},
        {"interactive": 8},
        {"interactive": 100, "batch": cap},
    )
    for waited in (0.0, 300.0):
        d = ac.decide(at_cap, "batch", 200, 128, 2, waited)
        assert isinstance(d, Reject) and "cap" in d.reason and d.retry_after_s >= 1
        assert d.kind == "queue_cap"


def test_batch_past_its_ttft_slo_is_admitted_on_seats_not_held_for_an_idle_replica():
    """A non-rejectable request whose TTFT SLO even an idle replica would now miss goes as
    soon as a seat is free; held for its TTFT, it would wait for an idle replica."""
    ac = AdmissionController()
    slo = DEFAULT_CLASSES["batch"].ttft_slo_s
    busy = snap(running={"batch": 8})
    standard = DEFAULT_CLASSES["standard"].ttft_slo_s
    assert isinstance(ac.decide(busy, "standard", 200, 128, 1, 2 * standard), Reject)
    assert ac.decide(busy, "batch", 200, 128, 2, 2 * slo) == Admit()
    full = snap(running={"batch": 64})
    assert isinstance(ac.decide(full, "batch", 200, 128, 2, 2 * slo), Wait)


def test_lower_priority_queue_does_not_block_interactive():
    ac = AdmissionController()
    s = snap({"batch": 500_000, "standard": 50_000}, {"batch": 20}, {"batch": 999, "standard": 100})
    assert ac.decide(s, "interactive", 200, 128, 0, 0.0) == Admit()
    assert ac.predict(s, "interactive", 200).tokens_ahead == 0
    # ...but it blocks standard (standard queue ahead) and, under FCFS, interactive too.
    assert isinstance(ac.decide(s, "standard", 200, 128, 1, 0.0), Wait)
    fcfs = AdmissionController(policy=FCFSPolicy())
    assert isinstance(fcfs.decide(s, "interactive", 200, 128, 0, 0.0), Wait)


def test_seats_taken_by_urgent_work_block_and_by_preemptible_work_do_not():
    ac = AdmissionController()
    full_of_batch = snap(running={"batch": 30, "interactive": 34})
    assert ac.decide(full_of_batch, "interactive", 50, 16, 0, 0.0) == Admit()
    full_of_urgent = snap(running={"interactive": 64})
    d = ac.decide(full_of_urgent, "interactive", 50, 16, 0, 0.0)
    assert isinstance(d, Wait) and "seat" in d.reason


def test_kv_shortage_waits_unless_less_urgent_blocks_can_be_reclaimed():
    ac = AdmissionController()
    tight = snap(kv_free=5, running={"batch": 4})
    d = ac.decide(tight, "interactive", 200, 16, 0, 0.0)  # 13 + 1 blocks > 5 free
    assert isinstance(d, Wait) and "KV" in d.reason
    reclaim = snap(kv_free=5, running={"batch": 4}, kv_blocks_used={"batch": 40})
    assert ac.decide(reclaim, "interactive", 200, 16, 0, 0.0) == Admit()


def test_tpot_of_running_requests_gates_admission():
    ac = AdmissionController()
    # 230 decodes: a step takes 0.05 + 0.002 * 231 = 0.51 s > the 0.5 s interactive SLO.
    s = snap(running={"standard": 230})
    s.max_num_seqs = 256
    d = ac.decide(s, "interactive", 20, 16, 0, 0.0)
    assert isinstance(d, Wait) and "TPOT" in d.reason
    # Standard's looser 1.0 s TPOT SLO allows it while no interactive request runs.
    assert ac.decide(s, "standard", 20, 16, 1, 0.0) == Admit()


def test_ttft_counts_the_step_in_flight_and_less_urgent_prefill_sharing_its_steps():
    ac = AdmissionController()
    a, b, c = COEFS
    alone = snap({"interactive": 300}, {"interactive": 12}, {"interactive": 1})
    assert ac.predict(alone, "interactive", 100).ttft_s == pytest.approx((a + 12 * c) + 400 * b)
    # A step is running (0.3 s) and batch prefill fills the rest of the 500-token budget:
    # under priority the batch tokens do not go first, but they lengthen the shared step.
    busy = snap(
        {"interactive": 300, "batch": 5000},
        {"interactive": 12},
        {"interactive": 1, "batch": 25},
        step_left_s=0.3,
    )
    pred = ac.predict(busy, "interactive", 100)
    assert pred.tokens_ahead == 300 and pred.steps == 1
    assert pred.ttft_s == pytest.approx(0.3 + (a + 12 * c) + 500 * b)


def test_ttft_follows_the_tpot_guards_prefill_cap():
    ac = AdmissionController()
    a, b, c = COEFS
    running = {"interactive": 10}
    plain = snap(running=running)
    guarded = snap(running=running, tpot_slo_guard=True, tpot_slo_guard_target=0.8)
    # Unguarded: 500 tokens fit one step of the 502-token budget.
    assert ac.predict(plain, "interactive", 500).steps == 1
    # A batch prompt, outranked by the running interactive decodes: steps stay within
    # 0.8 x 0.5 s with 10 decodes, so they prefill floor((0.4 - a - 10c) / b) = 165
    # tokens each: 4 steps.
    pred = ac.predict(guarded, "batch", 500)
    assert pred.steps == 4
    assert pred.ttft_s == pytest.approx(4 * (a + 10 * c) + 500 * b)
    # An interactive prompt is owed its TTFT SLO: the guard lets its steps run to the
    # full 0.5 s, floor((0.5 - a - 10c) / b) = 215 tokens each: 3 steps.
    pred = ac.predict(guarded, "interactive", 500)
    assert pred.steps == 3
    assert pred.ttft_s == pytest.approx(3 * (a + 10 * c) + 500 * b)
    # Nothing decoding under a TPOT SLO: no cap.
    assert ac.predict(snap(tpot_slo_guard=True), "interactive", 500).steps == 1


def test_less_urgent_decodes_sit_out_for_an_owed_prompt():
    a, b, c = COEFS
    guarded = snap(
        running={"interactive": 2, "batch": 20}, tpot_slo_guard=True, tpot_slo_guard_target=0.8
    )
    # Priority: the 20 batch decodes sit steps out for the owed interactive prompt, so
    # its steps carry 2 decodes and floor((0.5 - a - 2c) / b) = 223 tokens: 3 steps.
    pred = AdmissionController().predict(guarded, "interactive", 500)
    assert pred.steps == 3
    assert pred.ttft_s == pytest.approx(3 * (a + 2 * c) + 500 * b)
    # FCFS sheds nothing: all 22 decodes stay, floor((0.5 - a - 22c) / b) = 203 tokens.
    pred = AdmissionController(policy=FCFSPolicy()).predict(guarded, "interactive", 500)
    assert pred.steps == 3
    assert pred.ttft_s == pytest.approx(3 * (a + 22 * c) + 500 * b)
    # A running class unknown to the controller might outrank it: not owed.
    unknown = snap(
        running={"interactive": 2, "batch": 20, "mystery": 1},
        tpot_slo_guard=True,
        tpot_slo_guard_target=0.8,
    )
    assert AdmissionController().predict(unknown, "interactive", 500).steps == 4
    # A batch prompt is not owed while interactive decodes run: every decode stays and
    # the 0.8 target holds, floor((0.4 - a - 22c) / b) = 153 tokens: 4 steps.
    pred = AdmissionController().predict(guarded, "batch", 500)
    assert pred.steps == 4
    assert pred.ttft_s == pytest.approx(4 * (a + 22 * c) + 500 * b)


def test_an_owed_prompts_first_step_may_take_what_the_guard_lends():
    a, b, c = COEFS
    ac = AdmissionController()

    def guarded(owed_step_s):
        return snap(
            running={"interactive": 10},
            tpot_slo_guard=True,
            tpot_slo_guard_target=0.8,
            owed_step_s=owed_step_s,
        )

    # The decodes' credit lets the guard run a 1 s step for an owed prompt: the first
    # takes floor((1.0 - a - 10c) / b) = 465 tokens, the rest 35 at the full-SLO cap.
    pred = ac.predict(guarded(1.0), "interactive", 500)
    assert pred.steps == 2
    assert pred.ttft_s == pytest.approx(2 * (a + 10 * c) + 500 * b)
    # Without a loan, or one no longer than the full SLO, every step has the 215 cap.
    for lent in (0.0, 0.4):
        assert ac.predict(guarded(lent), "interactive", 500).steps == 3
    # A batch prompt is not owed while interactive decodes run: no loan for it.
    assert ac.predict(guarded(1.0), "batch", 500) == ac.predict(guarded(0.0), "batch", 500)


def test_fcfs_behind_the_guard_is_capped_but_sheds_nothing():
    a, b, c = COEFS
    running = {"interactive": 10, "batch": 20}
    guarded = snap(
        running=running, tpot_slo_guard=True, tpot_slo_guard_target=0.8, recent_step_s=0.6
    )
    fcfs = AdmissionController(policy=FCFSPolicy())
    pred = fcfs.predict(guarded, "interactive", 500)
    # Owed its TTFT (FCFS outranks nothing), the prompt's steps may run to the full
    # 0.5 s SLO with all 30 decodes kept: floor((0.5 - a - 30c) / b) = 195 tokens, so 3
    # steps; the TPOT counts all 31 decodes and no measured floor.
    assert pred.steps == 3
    assert pred.tpot_s == pytest.approx(a + b * 500 / 32 + c * 31)
    # Priority scheduling would shed the 20 batch decodes for it.
    prio = AdmissionController().predict(guarded, "interactive", 500)
    assert prio.tpot_s == pytest.approx(a + b * 500 / 32 + c * 11)
    # Unguarded FCFS waits out the measured 0.6 s steps; behind the guard it admits.
    assert fcfs.decide(guarded, "interactive", 100, 16, 0, 0.0) == Admit()
    plain = snap(running=running, recent_step_s=0.6)
    assert isinstance(fcfs.decide(plain, "interactive", 100, 16, 0, 0.0), Wait)


def test_measured_step_time_floors_tpot_unless_the_guard_holds_it():
    ac = AdmissionController()
    slow = snap(running={"interactive": 4}, recent_step_s=0.6)
    d = ac.decide(slow, "interactive", 20, 16, 0, 0.0)
    assert isinstance(d, Wait) and "TPOT 0.600" in d.reason
    fcfs = AdmissionController(policy=FCFSPolicy())
    assert isinstance(fcfs.decide(slow, "batch", 20, 16, 2, 0.0), Wait)  # 0.5 s binds it
    # With the guard, the replica sheds less urgent work to hold the SLO: the model rules.
    guarded = snap(running={"interactive": 4}, recent_step_s=0.6, tpot_slo_guard=True)
    assert ac.decide(guarded, "interactive", 20, 16, 0, 0.0) == Admit()


def test_unknown_class_and_bad_arguments():
    ac = AdmissionController()
    with pytest.raises(ValueError, match="unknown traffic class"):
        ac.decide(snap(), "gold", 10, 10, 0, 0.0)
    with pytest.raises(ValueError):
        ac.decide(snap(), "interactive", 10, 10, 0, -1.0)
    with pytest.raises(ValueError):
        ac.predict(snap(), "interactive", -5)


# -- LoadSnapshot and PredictionLog -------------------------------------------------------


def test_load_snapshot_round_trips_through_json():
    s = LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks_free=1234,
        block_size=16,
        waiting_prefill_tokens={"interactive": 300, "batch": 90_000},
        running_seqs={"standard": 7},
        waiting_requests={"interactive": 2, "batch": 450},
        kv_blocks_used={"standard": 88},
        kv_usage=0.42,
        step_coefficients=(0.031, 0.00071, 0.0042),
        timestamp=1_700_000_000.25,
    )
    wire = json.dumps(s.to_dict())
    back = LoadSnapshot.from_dict(json.loads(wire))
    assert back == s
    assert isinstance(back.step_coefficients, tuple)
    # Keys from a newer replica are ignored; missing optional ones take defaults.
    newer = {**json.loads(wire), "gpu_temperature": 71}
    assert LoadSnapshot.from_dict(newer) == s
    minimal = LoadSnapshot.from_dict(
        {"max_num_batched_tokens": 256, "max_num_seqs": 8, "num_kv_blocks_free": 10}
    )
    assert minimal.running_seqs == {} and minimal.total_running == 0
    with pytest.raises(TypeError):
        LoadSnapshot.from_dict({"max_num_seqs": 8})


def test_load_snapshot_with_queued_counts_each_request_once_and_leaves_the_original():
    s = LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks_free=10,
        waiting_prefill_tokens={"batch": 100},
        waiting_requests={"batch": 1},
        running_seqs={"batch": 3},
    )
    more = s.with_queued([("batch", 40), ("interactive", 7), ("interactive", 5)])
    assert more.waiting_requests == {"batch": 2, "interactive": 2}
    assert more.waiting_prefill_tokens == {"batch": 140, "interactive": 12}
    assert more.running_seqs == {"batch": 3} and more.num_kv_blocks_free == 10
    assert s.waiting_requests == {"batch": 1} and s.waiting_prefill_tokens == {"batch": 100}
    assert s.with_queued([]) == s


def test_prediction_log():
    log = PredictionLog()
    assert math.isnan(log.mean_absolute_error()) and math.isnan(log.median_relative_error())
    for predicted, actual in ((1.0, 1.0), (2.0, 1.0), (1.5, 2.0), (0.3, 0.0)):
        log.record(predicted, actual)
    assert len(log) == 4
    assert log.mean_absolute_error() == pytest.approx((0 + 1 + 0.5 + 0.3) / 4)
    # Relative errors 0, 1, 0.25 (actual 0 is skipped): median 0.25.
    assert log.median_relative_error() == pytest.approx(0.25)
    assert log.summary()["count"] == 4
