"""The scheduler on a fake clock, as the policy and TPOT-guard tests drive it."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import Scheduler
from policies import PriorityPolicy
from tests.test_scheduler import FakeClock, distinct_prompt


def make(policy, num_blocks=1000, block_size=4, **cfg):
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **cfg)
    clock = FakeClock()
    return Scheduler(config, BlockManager(num_blocks, block_size), policy, clock), clock


def req(rid, prompt_len, max_tokens, arrival, priority=0, cls="standard"):
    return Request(
        rid,
        distinct_prompt(rid, prompt_len),
        SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival,
        max_tokens=max_tokens,
        priority=priority,
        traffic_class=cls,
    )


def guarded(max_num_seqs=32, budget=512, target=1.0):
    """Scheduler with the TPOT guard on a step model of 0.1 s + 0.001 s/prefill token +
    0.02 s/decode: 0.5 s TPOT holds up to 20 decodes (at ``target`` 1: the full SLO)."""
    from policies import StepTimeModel

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
    r = req(rid, prompt_len, max_tokens, arrival, priority=priority)
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
