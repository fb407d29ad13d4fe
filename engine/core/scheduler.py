"""Iteration-level scheduler with chunked prefill over a paged KV cache.

Each call of :meth:`Scheduler.schedule` builds one mixed step under a token budget
(``max_num_batched_tokens``) and ``max_num_seqs``, filled in this order:

1. the decode token of every running request that has finished its prefill;
2. the next chunk of every running request still prefilling;
3. new (or preempted) requests, in the order the policy gives.

Iteration-level scheduling is Orca's (Yu et al., OSDI 2022, section 3.1); chunked prefill
that piggybacks decodes is Sarathi-Serve's (Agrawal et al., OSDI 2024, section 4);
preemption by recompute is vLLM's (Kwon et al., SOSP 2023, section 4.5).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.kv_cache import BlockManager
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.schedule_output import PrefillBudget, ScheduledSeq, SchedulerOutput
from policies.base import SchedulingPolicy
from policies.slo_guard import GuardPlan, TpotGuard, prompt_line
from policies.step_time import StepTimeModel


class Scheduler:
    """Decides which tokens of which requests run in each step.

    The scheduler owns the waiting and running queues and the block manager. It reads
    time only through ``clock`` and calls ``policy`` for every ordering decision, so a
    test or simulator can drive it with fake time and no model.
    """

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        policy: SchedulingPolicy,
        clock: Callable[[], float] = time.monotonic,
        step_time: StepTimeModel | None = None,
    ) -> None:
        """``step_time``: the step-time model the engine feeds and the TPOT guard
        predicts with (a new one if None). The guard runs when
        ``config.tpot_slo_guard`` says so."""
        self.config = config
        self.step_time = step_time or StepTimeModel()
        self.guard = (
            TpotGuard(
                policy,
                self.step_time,
                target=config.tpot_slo_guard_target,
                block_size=block_manager.block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                rules_off=frozenset(config.tpot_slo_guard_rules_off),
            )
            if config.tpot_slo_guard
            else None
        )
        """The TPOT SLO guard (:mod:`policies.slo_guard`), or None when it is off."""
        self.block_manager = block_manager
        self.policy = policy
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        """Preemptions since start (a counter for tests and metrics)."""
        self._head_skips: tuple[str | None, int] = (None, 0)
        """(id of the waiting head that lacks KV room, how often it was overtaken)."""
        self._plan = GuardPlan()
        """This step's TPOT guard plan."""
        self._chunk_cap = (
            config.long_prefill_token_threshold or config.max_num_batched_tokens
            if config.enable_chunked_prefill
            else None
        )

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> Scheduler:
        """The scheduler ``config`` describes: its policy (``config.policy`` and its
        options) and, when ``config.tpot_slo_guard``, the TPOT guard."""
        return cls(config, block_manager, config.make_policy(), clock)

    @property
    def last_guard(self) -> GuardPlan:
        """The TPOT guard plan of the step last scheduled (for step logs; defaults: off)."""
        return self._plan

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan the next step; allocates the KV blocks its tokens need.

        ``now``: the step's time on the clock (default: read it). The engine passes its
        step's start, so that the step log's ``t`` is the time the plan was made for
        and a replay of the log plans at the same instant.
        """
        out = SchedulerOutput()
        self._fill(out, self.clock() if now is None else now)
        for seq in out.seqs:
            rid = seq.request.request_id
            out.block_tables[rid] = self.block_manager.block_table(rid)
        return out

    def _fill(self, out: SchedulerOutput, now: float) -> None:
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        # One sort of the waiting queue per step; again only if preemption changed it.
        waiting_order = self.policy.order(self.waiting, now)
        self._preempt_for_urgent(out, waiting_order, now)
        order = self.policy.order(self.running, now)
        guard = self._plan = self._guard_plan(order, waiting_order, now)
        for req in guard.shed:
            self.preempt(req)
            out.preempted.append(req)
        num_urgent_preemptions = len(out.preempted)

        # 1. Decodes.
        budget = self._decodes(out, order, budget, scheduled, guard.deferred)
        budget = PrefillBudget(budget, min(budget, guard.cap), min(budget, guard.owed))
        kv_exhausted = len(out.preempted) > num_urgent_preemptions

        # 2. Chunks of prompts already being prefilled, most urgent first. Before each,
        # waiting requests that outrank it (enough to preempt it) are admitted with their
        # first chunks: else a batch prompt admitted earlier would hold an interactive
        # arrival's prefill back until it is done.
        for urgent, req in prompt_line(order, waiting_order, now, self.policy, _prefilling):
            if budget.total == 0 or req is None:
                break
            if urgent and not kv_exhausted:
                self._admit(out, urgent, budget, now, guard.slo)
                if budget.total == 0:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted in this loop to make room for a more urgent prompt
            n = self._chunk(req, self._allowance(req, budget, now))
            if n == 0:
                continue
            room = self._free_capacity(req)
            if room == 0 and not out.seqs:
                # Nothing else progresses this step: take blocks from a less urgent request
                # so the system cannot deadlock on half-prefilled prompts.
                if not self._make_room(req, req.num_computed_tokens + 1, scheduled, out):
                    continue
                room = self._free_capacity(req)
            n = min(n, room)
            if n == 0:
                continue
            self.block_manager.allocate(req.request_id, req.num_computed_tokens + n)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            scheduled.add(req.request_id)
            budget.take(n)

        # 3. New and preempted requests, in the policy's order. Not after running out of
        # KV blocks: the cache is full, and a victim re-admitted at once would only thrash.
        if len(out.preempted) > num_urgent_preemptions:  # grows: kv_exhausted stays true
            return
        if out.preempted:
            waiting_order = self.policy.order(self.waiting, now)
        else:
            waiting_order = [r for r in waiting_order if r.status is RequestStatus.WAITING]
        self._admit(out, waiting_order, budget, now, guard.slo)

    def _decodes(
        self,
        out: SchedulerOutput,
        order: list[Request],
        budget: int,
        scheduled: set[str],
        deferred: frozenset[str],
    ) -> int:
        """Schedule the decode token of each running request in ``order`` that has one,
        except ``deferred``; return the budget left. Iterating most urgent first means
        any victim taken from the not-yet-scheduled tail is no more urgent than the
        request being served."""
        for req in order:
            if budget == 0:
                break
            if (
                req.status is not RequestStatus.RUNNING
                or req.num_pending_tokens != 1
                or req.request_id in deferred
            ):
                continue
            if not self._make_room(req, req.num_tokens, scheduled, out):
                continue
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, 1))
            scheduled.add(req.request_id)
            budget -= 1
        out.num_decodes = len(out.seqs)
        return budget

    def _guard_plan(
        self, order: list[Request], waiting_order: list[Request], now: float
    ) -> GuardPlan:
        """The TPOT guard's plan for this step; the defaults (no cap) with the guard off."""
        if self.guard is None:
            return GuardPlan()
        return self.guard.plan(order, waiting_order, now, _prefilling)

    def _allowance(self, req: Request, budget: PrefillBudget, now: float) -> int:
        """Prefill tokens ``req`` may take this step: the guard's cap for prompts its
        binding decode outranks, else what the prompts owed their TTFT may take
        (:attr:`GuardPlan.owed`); a prompt earlier in line takes it first."""
        binder = self._plan.binder
        if binder is None or req.output_token_ids or self.policy.outranks(binder, req):
            return budget.capped
        return budget.owed

    def _admit(
        self,
        out: SchedulerOutput,
        waiting_order: list[Request],
        budget: PrefillBudget,
        now: float,
        slo: float = math.inf,
    ) -> None:
        """Admit waiting requests in ``waiting_order`` with their first chunks, taking
        their tokens from ``budget``."""
        policy, bm = self.policy, self.block_manager
        num_running = len(self.running)
        blocked_head: Request | None = None
        adapters = {r.lora.name for r in self.running if r.lora is not None}
        lora_blocked = False
        for req in waiting_order:
            if budget.total == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.lora is not None and (
                lora_blocked
                or (req.lora.name not in adapters and len(adapters) >= self.config.max_loras)
            ):
                # Every slot is taken by running requests' adapters. Requests behind this
                # one go on only with the base model: those with a running adapter would
                # keep its slot taken for ever under a steady stream, starving this one.
                lora_blocked = True
                continue
            if not policy.may_admit(req, num_running, len(self.waiting), now):
                continue
            if (
                self.guard is not None
                and self.guard.sheds_at_once(req, len(self.running), slo)
                and not policy.preempts(req, policy.pick_victim(self.running), now)
            ):
                # The TPOT guard would shed it again at once. A request that outranks
                # running work is admitted: the guard sheds that work for it instead.
                continue
            prefix = self.cached_prefix(req)
            start = len(prefix) * bm.block_size
            n = self._chunk(req, self._allowance(req, budget, now), start)
            if n == 0:
                if budget.capped == 0 and budget.total > 0:
                    continue  # the cap is spent; a later prompt may be owed more for its TTFT
                break
            if not bm.can_allocate(req.request_id, start + n, prefix):
                if blocked_head is None:
                    blocked_head = req
                if policy.max_head_of_line_skips == 0:
                    break
                continue
            if blocked_head is not None:
                # Bounded overtaking: once the head has been passed this many times, stop
                # admitting so that finishing requests free blocks for it.
                head_id, skips = self._head_skips
                skips = skips + 1 if head_id == blocked_head.request_id else 1
                if skips > policy.max_head_of_line_skips:
                    break
                self._head_skips = (blocked_head.request_id, skips)
            bm.allocate(req.request_id, start + n, prefix)
            bm.record_lookup(req.num_tokens, start)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.num_cached_tokens = start
            req.num_computed_tokens = start
            req.mark_scheduled(now)
            self.running.append(req)
            if req.lora is not None:
                adapters.add(req.lora.name)
            policy.on_admit(req, now)
            out.seqs.append(ScheduledSeq(req, start, n))
            budget.take(n)

    def _preempt_for_urgent(
        self, out: SchedulerOutput, waiting_order: list[Request], now: float
    ) -> None:
        """Let waiting requests the policy deems more urgent displace running ones.

        Walks the waiting order; for each request blocked by ``max_num_seqs`` or KV room,
        preempts the policy's victims while the policy says the waiting request outranks
        them. Stops at the first request that cannot be made to fit.
        """
        bm = self.block_manager
        seats = blocks = 0
        for req in waiting_order:
            chunk = self._chunk(req, self.config.max_num_batched_tokens) or req.num_pending_tokens
            seats += 1
            blocks += bm.blocks_needed(chunk)
            while self.running and (
                len(self.running) + seats > self.config.max_num_seqs or bm.num_free_blocks < blocks
            ):
                victim = self.policy.pick_victim(self.running)
                if not self.policy.preempts(req, victim, now):
                    return
                self.preempt(victim)
                out.preempted.append(victim)
            if len(self.running) + seats > self.config.max_num_seqs or bm.num_free_blocks < blocks:
                return

    def cached_prefix(self, req: Request) -> list[int]:
        """The cached KV blocks ``req`` may start from; none when it asks for prompt
        logprobs, which need the logits of every prompt position, nor for an embedding
        request under ``mean`` pooling, which needs the hidden states of every prompt
        position (a cached block holds only its KV)."""
        if req.params.prompt_logprobs is not None or (
            req.pooling is not None and self.config.embedding_pooling == "mean"
        ):
            return []
        return self.block_manager.cached_prefix(req.token_ids, req.request_id, req.lora_key)

    def _chunk(self, req: Request, budget: int, start: int | None = None) -> int:
        """Tokens of ``req``'s prefill from ``start`` (default: its computed tokens) that
        fit this step's remaining ``budget``."""
        pending = req.num_tokens - (req.num_computed_tokens if start is None else start)
        if self._chunk_cap is None:
            return pending if pending <= budget else 0
        return min(pending, budget, self._chunk_cap)

    def _free_capacity(self, req: Request) -> int:
        """Tokens ``req`` could add using its own spare slots plus every free block."""
        bm = self.block_manager
        held = len(bm.block_table(req.request_id)) + bm.num_free_blocks
        return held * bm.block_size - req.num_computed_tokens

    def _make_room(
        self, req: Request, total_tokens: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        """Allocate blocks for ``req`` to hold ``total_tokens``, preempting as needed.

        Victims are chosen by the policy among running requests not scheduled in this
        step, ``req`` included. Returns False when ``req`` itself was the victim.
        """
        bm = self.block_manager
        while not bm.can_allocate(req.request_id, total_tokens):
            candidates = [r for r in self.running if r.request_id not in scheduled and r is not req]
            victim = self.policy.pick_victim([*candidates, req])
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        bm.allocate(req.request_id, total_tokens)
        return True

    def preempt(self, req: Request) -> None:
        """Send a running request back to WAITING; its KV is dropped and recomputed later."""
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Account for an executed step.

        Args:
            out: the step that ran.
            sampled: request id -> token id for each request whose chunk sampled (an
                embedding request's chunk that reached its last token has none).

        Returns:
            The requests that received a new token, and the embedding requests whose
            prompt is done (their pooled vector is the step's result), in ``out.seqs``
            order.
        """
        got_token = []
        for seq in out.seqs:
            req = seq.request
            req.num_computed_tokens = seq.start + seq.num_tokens
            self.block_manager.commit(
                req.request_id, req.token_ids, req.num_computed_tokens, req.lora_key
            )
            if seq.samples:
                if req.pooling is None:
                    req.append_token(sampled[req.request_id])
                got_token.append(req)
        return got_token

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        """Remove ``req`` from its queue and free its blocks (also used for abort)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.block_manager.free(req.request_id)
        self.policy.on_finish(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = now


def _prefilling(req: Request) -> bool:
    """Running and still prefilling (a decode has exactly one token pending)."""
    return req.status is RequestStatus.RUNNING and req.num_pending_tokens > 1
