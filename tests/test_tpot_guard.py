"""The TPOT guard (fake runner, fake clock; :mod:`policies.slo_guard`): shedding, the
prefill cap and TPOT credit; and, for prompts owed their TTFT, sitting out, the last gap, the
deadline and lending."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.kv_cache import BlockManager
from engine.core.request import FinishReason, RequestStatus
from engine.core.scheduler import Scheduler
from policies import PriorityPolicy, StepTimeModel
from tests.test_scheduler import FakeClock, fake_step, make_request


def guarded(max_num_seqs=32, budget=512, target=1.0):
    """Scheduler with the TPOT guard on a step model of 0.1 s + 0.001 s/prefill token +
    0.02 s/decode: 0.5 s TPOT holds up to 20 decodes (at ``target`` 1: the full SLO)."""
    model = StepTimeModel(prior=(0.1, 0.001, 0.02), min_samples=10**9)  # fixed: the prior
    config = EngineConfig(
        block_size=4,
        num_kv_blocks=4000,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        tpot_slo_guard_target=target,
        tpot_slo_guard=True,
    )
    clock = FakeClock()
    sched = Scheduler(
        config,
        BlockManager(4000, 4),
        PriorityPolicy(aging_s_per_level=None),
        clock,
        step_time=model,
    )
    return sched, clock, model


def guarded_req(rid, arrival, priority, slo, prompt_len=8, max_tokens=500, ttft_slo=None):
    r = make_request(rid, prompt_len, max_tokens, arrival, priority=priority)
    r.tpot_slo_s = slo
    if ttft_slo is not None:
        r.ttft_slo_s = ttft_slo
    return r


def model_step(sched, clock, model):
    """One step as the engine runs it, with the step model's time as the step's time:
    first tokens are stamped, and length-capped requests finish."""
    out = sched.schedule()
    clock.t += model.predict(out.num_batched_tokens - out.num_decodes, out.num_decodes)
    for r in sched.update(out, {s.request.request_id: 7 for s in out.seqs if s.samples}):
        if r.first_token_time is None:
            r.first_token_time = clock()
        if len(r.output_token_ids) >= r.max_tokens:
            sched.finish(r, FinishReason.LENGTH, clock())
    sched.block_manager.check()
    return out


def mean_tpot(r, now):
    return (now - r.first_token_time) / max(1, len(r.output_token_ids) - 1)


@pytest.mark.parametrize("target,kept", [(1.0, 20), (0.8, 15)])
def test_tpot_guard_sheds_batch_decodes_for_an_interactive_slo(target, kept):
    sched, clock, model = guarded(target=target)
    batch = [guarded_req(f"b{i}", 0.01 * i, priority=2, slo=5.0) for i in range(30)]
    for r in batch:
        sched.add(r)
    for _ in range(3):
        fake_step(sched, clock)
    assert len(sched.running) == 30  # 30 decodes: 0.7 s, within batch's 5 s SLO
    urgent = guarded_req("urgent", clock(), priority=0, slo=0.5, prompt_len=1000, max_tokens=10)
    sched.add(urgent)
    steps = 0
    while urgent.first_token_time is None and not urgent.output_token_ids:
        out = fake_step(sched, clock)
        steps += 1
        assert not out.preempted  # while it prefills, its TPOT SLO does not bind yet
    # 1000 tokens at the full budget less 30 decodes (482 a step): 3 steps.
    assert steps == 3
    out = fake_step(sched, clock)
    # The urgent request plus batch decodes up to the limit: 20 x 0.02 + 0.1 = 0.5 s at
    # the full SLO, 15 x 0.02 + 0.1 = 0.4 s at 0.8 of it.
    assert len(sched.running) == kept and len(out.preempted) == 31 - kept
    assert all(r.priority == 2 for r in out.preempted)
    for _ in range(5):  # shed requests are not re-admitted while the urgent one runs
        out = fake_step(sched, clock)
        assert model.predict(0, out.num_decodes) <= 0.5 * target + 1e-9
    while not urgent.is_finished:
        fake_step(sched, clock)
    fake_step(sched, clock)
    fake_step(sched, clock)
    assert len(sched.running) == 30  # batch work resumes at full width


def test_tpot_guard_caps_prefill_and_admits_work_that_outranks_the_running():
    sched, clock, model = guarded()
    for i in range(30):
        sched.add(guarded_req(f"b{i}", 0.01 * i, priority=2, slo=5.0))
    first = guarded_req("first", 0.5, priority=1, slo=0.5, max_tokens=400)
    sched.add(first)
    for _ in range(4):
        fake_step(sched, clock)
    assert first.output_token_ids and len(sched.running) == 20  # shed to the 0.5 s SLO
    # A more urgent prompt still gets in (the guard sheds batch decodes for it) ...
    second = guarded_req("second", clock(), priority=0, slo=0.5, prompt_len=400)
    sched.add(second)
    out = fake_step(sched, clock)
    assert second.status is RequestStatus.RUNNING
    # ... and while the 0.5 s SLO binds, each step's prefill is capped to fit it.
    for _ in range(5):
        out = fake_step(sched, clock)
        prefill = out.num_batched_tokens - out.num_decodes
        assert prefill > 0
        assert model.predict(prefill, out.num_decodes) <= 0.5 + 1e-9 or prefill == 4


def test_tpot_guard_never_sheds_more_urgent_work():
    sched, clock, _ = guarded()
    for i in range(25):
        sched.add(guarded_req(f"i{i}", 0.01 * i, priority=0, slo=0.5))
    for _ in range(3):
        out = fake_step(sched, clock)
        assert not out.preempted
    assert len(sched.running) == 25  # same class: the guard does not preempt its own peers


@pytest.mark.parametrize(
    "ttft_slo,banking_steps,stretched",
    [
        (2.0, 10, True),  # the decodes banked TPOT credit in fast steps: the peer spends it
        (2.0, 0, False),  # they have just started: no credit, the peer stays under the cap
        (float("inf"), 10, False),  # no TTFT SLO to meet: no reason to stretch
    ],
)
def test_tpot_guard_lets_a_same_class_prompt_spend_the_decodes_tpot_credit_for_its_ttft(
    ttft_slo, banking_steps, stretched
):
    sched, clock, model = guarded()
    peers = [guarded_req(f"i{i}", 0.01 * i, priority=0, slo=0.5) for i in range(5)]
    for r in peers:
        sched.add(r)
    for _ in range(1 + banking_steps):  # prefill, then decode-only steps of 0.2 s < 0.5 s
        model_step(sched, clock, model)
    peer = guarded_req(
        "peer", clock(), priority=0, slo=0.5, prompt_len=1600, max_tokens=4, ttft_slo=ttft_slo
    )
    sched.add(peer)
    sched.add(guarded_req("batch", clock(), priority=2, slo=5.0, prompt_len=1600, ttft_slo=60.0))
    # (0.5 s - 0.1 s - 5 decodes x 0.02 s) / 0.001 s per token; the decodes' credit, spread
    # over their ~490 tokens left, adds a few tokens.
    cap = 300 + 10
    steps, peer_chunks = 0, []
    while not peer.output_token_ids:
        out = model_step(sched, clock, model)
        steps += 1
        chunks = {s.request.request_id: s.num_tokens for s in out.seqs if s.num_tokens > 1}
        peer_chunks.append(chunks.get("peer", 0))
        # Peer chunks beyond the cap displace the batch prompt; the two never exceed it.
        assert chunks.get("batch", 0) <= max(0, cap - chunks.get("peer", 0))
        assert out.num_batched_tokens <= 512
        # Stretched or not, no decode's mean TPOT so far exceeds its share of the SLO.
        assert all(mean_tpot(r, clock()) <= 0.5 + 1e-9 for r in peers)
    if stretched:
        # 1600 tokens with 2 s left and steps of about 0.5 s: 3 steps of 534, so the first
        # takes the whole budget (512 - 5 decodes); the cap alone needs 6 steps.
        assert peer_chunks[0] == 507 and steps < 6
    else:
        assert max(peer_chunks) <= cap and steps == 6


def test_tpot_guard_pays_back_a_slow_step_with_smaller_chunks():
    sched, clock, model = guarded(target=0.8)  # share 0.4 s of the 0.5 s SLO
    short = guarded_req("short", 0.0, priority=0, slo=0.5, max_tokens=4)
    sched.add(short)
    model_step(sched, clock, model)  # prefill: its first token
    model_step(sched, clock, model)  # a decode the model puts at 0.12 s ...
    clock.t += 0.6  # ... ran 0.72 s: 0.32 s of debt against the share, 2 tokens left
    sched.add(guarded_req("batch", clock(), priority=2, slo=5.0, prompt_len=2000))
    chunks = []
    while not short.is_finished:
        out = model_step(sched, clock, model)
        chunks.append(out.num_batched_tokens - out.num_decodes)
    # Paying 0.16 s back a step would need 0.24 s steps; repayment stops at the headroom,
    # 0.4 - (0.5 - 0.4) = 0.3 s: (0.3 - 0.1 - 0.02) / 0.001 = 180 tokens a step. The share
    # alone allows 280, and would leave a mean TPOT of (0.72 + 2 x 0.4) / 3 = 0.507 s.
    assert len(chunks) == 2 and all(abs(c - 180) <= 1 for c in chunks)  # float rounding
    assert mean_tpot(short, short.finish_time) <= 0.5


def test_a_batch_decodes_tpot_debt_never_squeezes_interactive_prompts():
    sched, clock, model = guarded(target=0.8)
    inter = guarded_req("inter", 0.0, priority=0, slo=0.5)
    batch = guarded_req("batch", 0.0, priority=2, slo=5.0, max_tokens=27)
    sched.add(inter)
    sched.add(batch)
    model_step(sched, clock, model)
    model_step(sched, clock, model)
    batch.first_token_time = clock() - 100.0  # e.g. shed for a long time: 96 s of debt
    prompt = guarded_req("prompt", clock(), priority=0, slo=0.5, prompt_len=1000)
    sched.add(prompt)
    out = model_step(sched, clock, model)
    # Spread over its 25 tokens left, the batch decode's debt would ask for 0.16 s steps;
    # its repayment stops at 4 - 1 = 3 s, so the interactive share binds:
    # (0.4 - 0.1 - 2 x 0.02) / 0.001 = 260 tokens.
    chunk = {s.request.request_id: s.num_tokens for s in out.seqs}["prompt"]
    assert abs(chunk - 260) <= 1


def test_a_decode_without_a_tpot_slo_does_not_limit_the_guard():
    sched, clock, model = guarded(target=0.8)
    sched.add(make_request("plain", 8, 50, 0.0, priority=2))  # tpot_slo_s left at inf
    sched.add(guarded_req("inter", 0.01, priority=0, slo=0.5))
    for _ in range(3):
        model_step(sched, clock, model)
    sched.add(guarded_req("batch", clock(), priority=1, slo=5.0, prompt_len=1000))
    out = model_step(sched, clock, model)
    # The interactive share binds: (0.4 + its credit / 497 tokens left - 0.1 - 2 x 0.02)
    # / 0.001 s per token = 261 prefill tokens.
    assert out.num_batched_tokens - out.num_decodes == 261


def test_prompts_of_the_binders_class_meet_their_ttft_in_line_while_it_repays_debt():
    sched, clock, model = guarded(target=0.8)  # share 0.4 s of the 0.5 s TPOT SLO
    inter = [guarded_req(f"i{i}", 0.0, priority=0, slo=0.5, max_tokens=12) for i in range(2)]
    batch = [guarded_req(f"b{i}", 0.0, priority=2, slo=5.0) for i in range(5)]
    for r in (*inter, *batch):
        sched.add(r)
    model_step(sched, clock, model)
    model_step(sched, clock, model)
    for r in inter:
        r.first_token_time -= 2.0  # e.g. a slow stretch: 2 s of TPOT debt, 10 tokens left
    first = guarded_req("first", clock(), priority=0, slo=0.5, prompt_len=500, max_tokens=2)
    second = guarded_req(
        "second", clock() + 1e-3, priority=0, slo=0.5, prompt_len=500, max_tokens=2
    )
    batch_prompt = guarded_req("bp", clock(), priority=2, slo=5.0, prompt_len=2000)
    for r in (first, second, batch_prompt):
        r.ttft_slo_s = 3.0 if r is not batch_prompt else 60.0
        sched.add(r)
    while not second.output_token_ids:
        out = model_step(sched, clock, model)
        chunks = {s.request.request_id: s.num_tokens for s in out.seqs if s.num_tokens > 1}
        # The debt pulls the cap to the repayment floor, 0.4 - (0.5 - 0.4) = 0.3 s: (0.3 -
        # 0.1 - 7 x 0.02) / 0.001 = 60 tokens, which is all the batch prompt may take. The
        # interactive prompts may take up to the share: 160 tokens, in line.
        assert chunks.get("bp", 0) <= 60
        assert (
            model.predict(out.num_batched_tokens - out.num_decodes, out.num_decodes) <= 0.4 + 1e-9
        )
    # In steps of at most 0.4 s, 1000 tokens at 160 a step meet a 3 s TTFT; the first
    # prompt is served first, not spread out to finish just in time beside the second.
    assert first.first_token_time - first.arrival_time <= 1.7
    assert second.first_token_time - second.arrival_time <= 3.0


def _batch_and_two_interactive_decoding():
    """The guard at the full 0.5 s SLO over 10 batch decodes with TPOT credit (after
    decode-only steps of 0.3 s, far under batch's 5 s) and 2 interactive decodes without
    credit (just past their prefill)."""
    sched, clock, model = guarded()
    batch = [guarded_req(f"b{i}", 0.01 * i, priority=2, slo=5.0) for i in range(10)]
    for r in batch:
        sched.add(r)
    for _ in range(4):
        model_step(sched, clock, model)
    inter = [guarded_req(f"i{i}", clock(), priority=0, slo=0.5) for i in range(2)]
    for r in inter:
        sched.add(r)
    model_step(sched, clock, model)
    return sched, clock, model, batch, inter


def test_decodes_an_interactive_prompt_outranks_sit_out_steps_for_its_ttft_while_credit_lasts():
    sched, clock, model, batch, inter = _batch_and_two_interactive_decoding()
    first = guarded_req(
        "first", clock(), priority=0, slo=0.5, prompt_len=400, max_tokens=2, ttft_slo=1.8
    )
    second = guarded_req(
        "second", clock() + 1e-3, priority=0, slo=0.5, prompt_len=400, max_tokens=2, ttft_slo=1.8
    )
    for r in (first, second):
        sched.add(r)
    # 12 decodes leave (0.5 - 0.1 - 12 x 0.02) / 0.001 = 160 tokens a step: 5 steps for
    # both prompts. By the 1.8 s deadline, 3 steps of 0.5 s fit: 800 / 3 = 267 a step, so
    # batch decodes must sit out step after step (each frees 20 tokens' time). On f0a923a,
    # none sat out two steps in a row: the second prompt got its first token at 1.86 s.
    sat_out_steps = 0
    while not second.output_token_ids:
        out = model_step(sched, clock, model)
        assert not out.preempted  # sitting out keeps the KV: nothing is recomputed
        # Steps may pass 0.5 s only by the time faster steps banked: the mean TPOT holds.
        assert all(mean_tpot(r, clock()) <= 0.5 + 1e-9 for r in inter)
        ran = {s.request.request_id for s in out.seqs}
        assert {"i0", "i1"} <= ran  # interactive decodes never sit out for a peer
        sat_out_steps += any(r.request_id not in ran for r in batch)
    assert sat_out_steps >= 2
    assert all(mean_tpot(r, clock()) <= 5.0 for r in batch)  # their credit covered it
    assert first.first_token_time - first.arrival_time <= 1.8
    assert second.first_token_time - second.arrival_time <= 1.8


def test_a_decode_running_past_the_aging_step_still_owes_a_fresh_peer_its_ttft():
    sched, clock, model = guarded()
    sched.policy = PriorityPolicy(aging_s_per_level=10.0)
    old = guarded_req("old", 0.0, priority=0, slo=0.5, max_tokens=1000)
    sched.add(old)
    while clock() < 11.0:  # decode-only steps of 0.12 s: it banks TPOT credit
        model_step(sched, clock, model)
    fresh = guarded_req(
        "fresh", clock(), priority=0, slo=0.5, prompt_len=1000, max_tokens=2, ttft_slo=1.3
    )
    sched.add(fresh)
    # The old decode has aged more than a level past the fresh prompt, yet its SLO is no
    # more urgent: the prompt is owed its TTFT and spends the decode's credit, 511 tokens
    # (the budget less the decode). On f0a923a it got only the cap (418, 418, 164 tokens:
    # its first token at 1.36 s).
    out = model_step(sched, clock, model)
    assert {s.request.request_id: s.num_tokens for s in out.seqs}["fresh"] == 511
    while not fresh.output_token_ids:
        model_step(sched, clock, model)
    assert fresh.first_token_time - fresh.arrival_time <= 1.3


def test_batch_decodes_sit_out_to_free_budget_tokens_for_an_interactive_prompts_ttft():
    sched, clock, model = guarded()
    batch = [guarded_req(f"b{i}", 0.01 * i, priority=2, slo=5.0) for i in range(10)]
    for r in batch:
        sched.add(r)
    for _ in range(4):  # decode-only steps of 0.3 s bank TPOT credit against batch's 5 s
        model_step(sched, clock, model)
    inter = guarded_req(
        "inter", clock(), priority=0, slo=0.5, prompt_len=1010, max_tokens=2, ttft_slo=1.5
    )
    sched.add(inter)
    # Only batch decodes run: their limit (seconds) does not bind, the 512-token budget
    # does. 502 tokens a step beside 10 decodes need 3 steps (0.80 + 0.80 + 0.31 s, past
    # 1.5 s); with the decodes sitting out, 512 + 498 need 2 (1.22 s). On 9df945c none
    # sat out (their TPOT credit was held against their own 5 s limit).
    chunks = []
    while not inter.output_token_ids:
        out = model_step(sched, clock, model)
        assert not out.preempted
        chunks.append({s.request.request_id: s.num_tokens for s in out.seqs}.get("inter"))
    assert chunks == [512, 498]
    assert inter.first_token_time - inter.arrival_time <= 1.5
    assert all(mean_tpot(r, clock()) <= 5.0 for r in batch)


def test_a_decode_sitting_out_is_not_run_as_a_prefill_chunk_with_the_cap_left_over():
    sched, clock, model, batch, _ = _batch_and_two_interactive_decoding()
    # A TTFT SLO of 0.4 s: one step left, so it needs all 170 tokens now.
    late = guarded_req(
        "late", clock(), priority=0, slo=0.5, prompt_len=170, max_tokens=2, ttft_slo=0.4
    )
    sched.add(late)
    out = model_step(sched, clock, model)
    # 12 decodes leave 160 tokens; one batch decode sitting out frees 20 more: 180, of
    # which the prompt takes 170. The 10 left must not run the idle decode after all.
    ran = {s.request.request_id for s in out.seqs}
    assert {s.request.request_id: s.num_tokens for s in out.seqs}["late"] == 170
    assert len([r for r in batch if r.request_id not in ran]) == 1
    assert out.num_decodes == len(out.seqs) - 1


@pytest.mark.parametrize(
    "max_tokens,prompt_priority,worst,chunk",
    [
        (2, 2, 1.4, 237),  # its last gap: (0.5 / 1.4 - 0.1 - 0.02) / 0.001 tokens
        (50, 2, 1.4, 305),  # 48 gaps left to average a slow step out: its 0.425 s share
        (2, 0, 1.4, 237),  # a peer's prompt owed its TTFT may not spend the last gap either
        # (0.5 / 2 - 0.12) / 0.001: below 2 * 0.425 - 0.5 = 0.35 s, the floor that a decode
        # with later gaps keeps (on 1a1b0b3 the last gap kept it too: 230 tokens, 0.70 s at 2x)
        (2, 2, 2.0, 130),
    ],
)
def test_a_decode_in_its_last_gap_keeps_its_step_within_its_slo_at_the_worst_ratio(
    max_tokens, prompt_priority, worst, chunk
):
    from policies import StepTimeModel

    class Jittery(StepTimeModel):
        """Steps ran at their prediction at the median; ``worst`` at worst."""

        def local_ratio(self):
            return 1.0

        def worst_ratio(self):
            return worst

    sched, clock, _ = guarded(target=0.85)
    model = sched.guard.model = Jittery(prior=(0.1, 0.001, 0.02), min_samples=10**9)
    short = guarded_req("short", 0.0, priority=0, slo=0.5, max_tokens=max_tokens)
    sched.add(short)
    model_step(sched, clock, model)  # its prefill: first token
    sched.add(
        guarded_req("bp", clock(), priority=prompt_priority, slo=5.0, prompt_len=2000, ttft_slo=1.0)
    )
    out = model_step(sched, clock, model)
    # A 2-token output's TPOT is this one step: at the worst ratio times its prediction
    # it must still end within 0.5 s. On c1659fc the prompt took the 0.425 s share (305
    # tokens): 0.595 s at 1.4x. On 2ab7f48 a prompt owed its TTFT still could.
    assert {s.request.request_id: s.num_tokens for s in out.seqs}["bp"] == chunk
    predicted = model.predict(out.num_batched_tokens - out.num_decodes, out.num_decodes)
    assert predicted * worst <= 0.5 + 1e-9 or max_tokens > 2


@pytest.mark.parametrize(
    "ttft_slo,chunk",
    [
        (2.5, 170),  # past its 2.0 s guard deadline, not its SLO: all its tokens now
        (2.0, 60),  # past its SLO already: the plain cap, no decode sits out for it
    ],
)
def test_a_prompt_past_its_guard_deadline_takes_its_tokens_while_its_slo_can_be_met(
    ttft_slo, chunk
):
    sched, clock, model = guarded(target=0.8)  # steps aimed at 0.4 s
    batch = [guarded_req(f"b{i}", 0.01 * i, priority=2, slo=5.0) for i in range(10)]
    for r in batch:
        sched.add(r)
    for _ in range(4):  # decode-only steps of 0.3 s bank credit against batch's 4 s share
        model_step(sched, clock, model)
    inter = [guarded_req(f"i{i}", clock(), priority=0, slo=0.5) for i in range(2)]
    for r in inter:
        sched.add(r)
    model_step(sched, clock, model)
    # Arrived 2.05 s ago (steps ran over its plan): 0.45 s to its SLO if it is 2.5 s.
    late = guarded_req(
        "late", clock() - 2.05, priority=0, slo=0.5, prompt_len=170, max_tokens=2, ttft_slo=ttft_slo
    )
    sched.add(late)
    out = model_step(sched, clock, model)
    ran = {s.request.request_id: s.num_tokens for s in out.seqs}
    # 12 decodes at the 0.4 s share leave (0.4 - 0.1 - 12 x 0.02) / 0.001 = 60 tokens;
    # 6 batch decodes sitting out free 120 more. On c1659fc a prompt past its guard
    # deadline was owed nothing: it got 60 tokens in this step (3 steps for 170).
    assert ran["late"] == chunk
    assert len([r for r in batch if r.request_id not in ran]) == (6 if chunk == 170 else 0)
    assert {"i0", "i1"} <= set(ran)
    if chunk == 170:
        assert late.first_token_time - late.arrival_time <= ttft_slo


@pytest.mark.parametrize(
    "ttft_slo,batch_in_last_step",
    [
        (1.2, 0),  # deadline 0.96 s: a full last step (0.707 s) would end at 1.41 s
        (3.0, 414),  # deadline 2.4 s: the full step ends in time, so the batch prompt fills it
    ],
)
def test_the_step_that_ends_an_owed_prompts_prefill_keeps_to_its_ttft_deadline(
    ttft_slo, batch_in_last_step
):
    sched, clock, model = guarded(target=0.8)
    batch = [guarded_req(f"b{i}", 0.0, priority=2, slo=5.0) for i in range(5)]
    for r in batch:
        sched.add(r)
    model_step(sched, clock, model)
    inter = guarded_req(
        "inter", clock(), priority=0, slo=0.5, prompt_len=600, max_tokens=2, ttft_slo=ttft_slo
    )
    sched.add(inter)
    sched.add(guarded_req("bp", clock(), priority=2, slo=5.0, prompt_len=2000, ttft_slo=60.0))
    # Only batch decodes run, so the budget binds, not their 4 s share: 507 tokens of
    # the prompt (0.1 + 0.507 + 5 x 0.02 = 0.707 s), then its last 93 ...
    out = model_step(sched, clock, model)
    assert {s.request.request_id: s.num_tokens for s in out.seqs}["inter"] == 507
    out = model_step(sched, clock, model)
    chunks = {s.request.request_id: s.num_tokens for s in out.seqs}
    assert chunks["inter"] == 93 and inter.output_token_ids
    # ... beside what of the batch prompt still ends the step by the deadline.
    assert chunks.get("bp", 0) == batch_in_last_step
    assert inter.first_token_time - inter.arrival_time <= ttft_slo


def test_an_owed_prompt_takes_all_the_credit_the_decodes_lend_not_just_its_need():
    sched, clock, model = guarded(target=0.8)  # the guard aims steps at 0.4 s
    peers = [guarded_req(f"i{i}", 0.0, priority=0, slo=0.5) for i in range(12)]
    for r in peers:
        sched.add(r)
    for _ in range(6):  # prefill, then 5 decode-only steps of 0.34 s: 0.3 s of credit
        model_step(sched, clock, model)
    prompt = guarded_req(
        "prompt", clock(), priority=0, slo=0.5, prompt_len=600, max_tokens=2, ttft_slo=2.1
    )  # deadline 0.8 x 2.1 = 1.68 s
    sched.add(prompt)
    out = model_step(sched, clock, model)
    # Its deadline needs 200 tokens a step (3 steps of 0.5 s by 1.68 s). It takes all the
    # peers' credit allows, (0.4 + 0.3 - 0.1 - 12 x 0.02) / 0.001 = 360, so its first
    # token comes a step earlier; on f6b2baf it took 200. The peers' mean TPOT holds.
    assert {s.request.request_id: s.num_tokens for s in out.seqs}["prompt"] == 360
    assert all(mean_tpot(r, clock()) <= 0.5 + 1e-9 for r in peers)
    while not prompt.output_token_ids:
        model_step(sched, clock, model)
    assert prompt.first_token_time - prompt.arrival_time <= 2.1


@pytest.mark.parametrize(
    "max_tokens,ttft_slo,chunk",
    [
        (500, 2.0, 360),  # decodes with 499 gaps left lend up to their full 0.5 s SLO
        (3, 2.0, 310),  # 2 gaps left: half of one later gap's 0.1 s headroom, 0.45 s
        (500, float("inf"), 260),  # no TTFT to meet: the share's cap
    ],
)
def test_decodes_with_later_gaps_lend_jitter_headroom_to_a_prompt_owed_its_ttft(
    max_tokens, ttft_slo, chunk
):
    sched, clock, model = guarded(target=0.8)  # share 0.4 s of the 0.5 s TPOT SLO
    decodes = [
        guarded_req(f"i{i}", 0.0, priority=0, slo=0.5, max_tokens=max_tokens) for i in range(2)
    ]
    for r in decodes:
        sched.add(r)
    model_step(sched, clock, model)  # their prefill: first tokens, no TPOT credit yet
    prompt = guarded_req("p", clock(), priority=0, slo=0.5, prompt_len=1000, ttft_slo=ttft_slo)
    sched.add(prompt)
    out = model_step(sched, clock, model)
    # The full SLO allows (0.5 - 0.1 - 2 x 0.02) / 0.001 = 360 tokens, more than the 334 a
    # step its 1.6 s deadline needs; it takes them all. The share allows (0.4 - 0.1 - 2 x
    # 0.02) / 0.001 = 260; on a1eba16 that was all the prompt could take (the same-class
    # decodes cannot sit out).
    assert {s.request.request_id: s.num_tokens for s in out.seqs}["p"] == chunk
    assert len(out.seqs) == 3
    if ttft_slo < float("inf"):  # the plan reports the lent step time (for admission)
        assert sched.last_guard.lent_s == pytest.approx(0.1 + 2 * 0.02 + chunk * 0.001)
    predicted = model.predict(out.num_batched_tokens - out.num_decodes, out.num_decodes)
    assert predicted <= 0.5 + 1e-9


def test_prompts_behind_one_that_missed_its_ttft_join_the_step_that_ends_its_prefill():
    sched, clock, model = guarded(target=0.8)
    decodes = [guarded_req(f"i{i}", 0.0, priority=0, slo=0.5) for i in range(2)]
    for r in decodes:
        sched.add(r)
    model_step(sched, clock, model)
    missed = guarded_req("missed", clock() - 2.1, priority=0, slo=0.5, prompt_len=10, ttft_slo=2.0)
    behind = [
        guarded_req(f"b{i}", clock() - 1.0, priority=0, slo=0.5, prompt_len=10, ttft_slo=2.0)
        for i in range(3)
    ]
    for r in (missed, *behind):
        sched.add(r)
    out = model_step(sched, clock, model)
    # Holding the step to what ends it by the first prompt's deadline saves no one once
    # that deadline has passed; on a1eba16 each of these prompts took a step of its own.
    assert all(r.output_token_ids for r in (missed, *behind))
    assert out.num_batched_tokens - out.num_decodes == 40
