"""The TPOT guard's shedding, prefill cap and TPOT credit (fake runner, fake clock;
:mod:`policies.slo_guard`)."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from tests.scheduling_setup import guarded, guarded_req, mean_tpot, model_step, req
from tests.test_scheduler import fake_step


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
    sched.add(req("plain", 8, 50, 0.0, priority=2))  # tpot_slo_s left at inf
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
