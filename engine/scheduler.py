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
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import BlockManager
from engine.request import FinishReason, Request, RequestStatus
from policies.base import SchedulingPolicy
from policies.step_time import StepTimeModel

OWED_BORROW = 0.5
"""Fraction of a decode's later gaps' jitter headroom (``tpot_slo_s`` minus its share, per
gap) that prompts owed their TTFT may spend in one step (:meth:`Scheduler._decode_limits`)."""


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: tokens ``[start, start + num_tokens)`` of its ids."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits sample."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class StepGuard:
    """One step's TPOT guard (:meth:`Scheduler._tpot_guard`); the defaults: guard off."""

    cap: float = math.inf
    """Prefill tokens any prompt may take."""
    owed: float = math.inf
    """Prefill tokens (at least ``cap``) the prompts that ``binder`` does not outrank may
    take, to meet their TTFT SLOs."""
    slo: float = math.inf
    """Tightest shedding limit, seconds."""
    binder: Request | None = None
    """The decode whose step-time limit binds; None when no decode has a TPOT SLO."""
    deferred: frozenset[str] = frozenset()
    """Ids of decodes that sit this step out, keeping their KV."""


@dataclass(slots=True)
class PrefillBudget:
    """A step's prefill tokens under the TPOT guard.

    ``total`` is what ``max_num_batched_tokens`` leaves after the decodes; ``capped`` is
    what any prompt may take (the guard's cap), ``owed`` what prompts owed their TTFT may
    take (:attr:`StepGuard.owed`); both at most ``total``.
    """

    total: int
    capped: int
    owed: int

    def take(self, n: int) -> None:
        self.total -= n
        self.capped = max(0, min(self.capped - n, self.total))
        self.owed = max(0, min(self.owed - n, self.total))


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``seqs`` holds the decodes (one token each) before the prefills."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decodes: int = 0
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> its block table, for every scheduled request."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


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
        self.config = config
        self.step_time = step_time
        """With a model, the TPOT SLO guard is on (see :meth:`_tpot_guard`)."""
        self.block_manager = block_manager
        self.policy = policy
        self.clock = clock
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        """Preemptions since start (a counter for tests and metrics)."""
        self._head_skips: tuple[str | None, int] = (None, 0)
        """(id of the waiting head that lacks KV room, how often it was overtaken)."""
        self._guard = StepGuard()
        """This step's TPOT guard."""
        self._step_ratio = 1.0
        """This step's ``StepTimeModel.local_ratio``, read once (guard on only)."""
        self._chunk_cap = (
            config.long_prefill_token_threshold or config.max_num_batched_tokens
            if config.enable_chunked_prefill
            else None
        )

    @property
    def last_guard(self) -> StepGuard:
        """The TPOT guard of the step last scheduled (for step logs; defaults: guard off)."""
        return self._guard

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step; allocates the KV blocks its tokens need."""
        out = SchedulerOutput()
        self._fill(out)
        for seq in out.seqs:
            rid = seq.request.request_id
            out.block_tables[rid] = self.block_manager.block_table(rid)
        return out

    def _fill(self, out: SchedulerOutput) -> None:
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        now = self.clock()
        # One sort of the waiting queue per step; again only if preemption changed it.
        waiting_order = self.policy.order(self.waiting, now)
        self._preempt_for_urgent(out, waiting_order, now)
        order = self.policy.order(self.running, now)
        guard = self._guard = self._tpot_guard(out, order, waiting_order, now)
        num_urgent_preemptions = len(out.preempted)

        # 1. Decodes. Iterating most urgent first means any victim taken from the
        # not-yet-scheduled tail is no more urgent than the request being served.
        for req in order:
            if budget == 0:
                break
            if (req.status is not RequestStatus.RUNNING or req.num_pending_tokens != 1
                    or req.request_id in guard.deferred):
                continue
            if not self._make_room(req, req.num_tokens, scheduled, out):
                continue
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, 1))
            scheduled.add(req.request_id)
            budget -= 1
        out.num_decodes = len(out.seqs)
        budget = PrefillBudget(budget, min(budget, guard.cap), min(budget, guard.owed))
        kv_exhausted = len(out.preempted) > num_urgent_preemptions

        # 2. Chunks of prompts already being prefilled, most urgent first. Before each,
        # waiting requests that outrank it (enough to preempt it) are admitted with their
        # first chunks: else a batch prompt admitted earlier would hold an interactive
        # arrival's prefill back until it is done.
        for urgent, req in self._prompt_line(order, waiting_order, now):
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

    def _tpot_guard(self, out: SchedulerOutput, order: list[Request],
                    waiting_order: list[Request], now: float) -> StepGuard:
        """Keep the step time within the running requests' TPOT SLOs (guard on only).

        Shedding: walks the running requests most urgent first, tracking the tightest
        step-time limit so far among those decoding (a TPOT SLO times
        ``tpot_slo_guard_target``); a request whose decode would push the predicted
        decode-only step time past that limit is preempted if the limit's owner outranks
        it (``policy.outranks``: so batch work yields to interactive work, never the
        reverse, nor a decode to an older one of its own class).

        Capping: the step's prefill tokens are capped so the predicted step time stays
        within every kept decode's limit: Sarathi-Serve's token budget derived from the
        TPOT SLO (Agrawal et al., OSDI 2024, section 4.3), per step instead of fixed.
        TPOT is a mean over a request's output, so each decode's limit is its SLO share
        plus its TPOT credit spread over the tokens it has left (:meth:`_decode_limits`):
        a step that ran slow is paid back by the next ones, and time banked by fast steps
        lets later steps take longer chunks. At least one block of prefill runs per step,
        so prompts always progress. Predictions are scaled by the step-time model's
        recent measured / predicted ratio (``StepTimeModel.local_ratio``), which corrects
        the global linear fit where the engine runs now, in both directions.

        TTFT: prompts the binding decode does not outrank (its own class, say) are owed
        their TTFT SLOs too. When the capped steps cannot serve them, in line, by their
        deadlines (:meth:`_owed_need`, counting steps at the full TPOT SLO, since steps run
        over their predictions, or at a full token budget's time where that is shorter),
        they may take more than the cap: up to the tightest SLO share (debt is then repaid
        only by prompts the binder outranks, so that repaying it cannot make a prompt of
        its own class miss its TTFT), and beyond it as far as every decode's TPOT credit,
        and half the jitter headroom of its later gaps, allow (the lent limit of
        :meth:`_decode_limits`): a decode with no credit and few gaps left (a short
        output, say) would miss its TPOT instead, and a decode in its last gap bounds the
        step even below the share. If that, or the token budget, is
        still short, decodes that the first owed prompt could preempt (``policy.preempts``)
        sit the step out, least urgent first, when their TPOT credit covers a step without
        a token (again in the next step, so a decode may sit out several in a row): each
        frees a decode's time and a budget token, and keeps its KV (unlike shedding,
        nothing is recomputed). The first prompt in line takes what the step allows first;
        in the step that ends its prefill, the prompts behind it take only what still ends
        the step by its TTFT deadline (its first token comes when the step ends), unless
        it has already missed its TTFT SLO.

        Returns:
            This step's guard; :class:`StepGuard`'s defaults (no cap) with the guard off
            or no decode under a TPOT SLO.
        """
        model = self.step_time
        if model is None:
            return StepGuard()
        target = self.config.tpot_slo_guard_target
        ratio = self._step_ratio = model.local_ratio()
        slo, owner, decoding = math.inf, None, []
        for req in order:
            # A request's TPOT SLO binds once it decodes; while it prefills, the prefill
            # budget should go to its TTFT instead.
            is_decoding = req.num_pending_tokens == 1
            if req.tpot_slo_s * target < slo and is_decoding:
                slo, owner = req.tpot_slo_s * target, req
            if (owner is not req and model.predict(0, len(decoding) + 1) * ratio > slo
                    and self.policy.outranks(owner, req)):
                self.preempt(req)
                out.preempted.append(req)
                continue
            if is_decoding:
                decoding.append(req)
        if math.isinf(slo):
            return StepGuard()
        _, b, _ = model.coefficients()

        def tokens_within(limit: float, decodes: int) -> float:
            spare = limit - model.predict(0, decodes) * ratio
            return math.floor(spare / (b * ratio)) if b > 0 else math.inf

        limit, binder, owed_limit, lent_limit = self._decode_limits(
            decoding, now, ratio / model.worst_ratio())
        owed = [r for urgent, req in self._prompt_line(order, waiting_order, now)
                for r in (*urgent, req)
                if r is not None and not r.output_token_ids
                and not self.policy.outranks(binder, r)]
        # The TTFT plan counts steps at the full SLO, not at the guard's target: steps run
        # over their prediction by the jitter that headroom is for (a tenth at the median,
        # a third at the 95th percentile on this CPU), and a plan that spends the TTFT
        # headroom on it finishes late. A step is no longer than a full token budget's,
        # whatever the SLO allows (a batch decode's limit is seconds).
        max_tokens = self.config.max_num_batched_tokens
        full_s = model.predict(max_tokens - len(decoding), len(decoding)) * ratio
        need = self._owed_need(owed, min(max(limit, slo), full_s) / target, now)
        kept, deferred = len(decoding), set()
        for req in reversed(decoding):  # least urgent first
            # Sitting out frees step time and a budget token: it helps while either binds.
            if not owed or need <= min(max_tokens - kept, tokens_within(owed_limit, kept)):
                break
            if not self.policy.preempts(owed[0], req, now):
                break  # the rest are at least as urgent
            if self._tpot_credit(req, now) >= min(owed_limit, full_s):
                deferred.add(req.request_id)
                kept -= 1
        cap = max(self.block_manager.block_size, tokens_within(limit, kept))
        # Sitting out is sized by the owed limit alone: a shorter step serves a prompt
        # that ends its prefill in it sooner. What the step still lacks is borrowed.
        owed_cap = max(cap, min(need, tokens_within(lent_limit, kept)))
        if owed and owed[0].num_pending_tokens <= min(owed_cap, max_tokens - kept):
            # The first prompt in line samples its first token when this step ends: the
            # prompts behind it (later deadlines) may add only what still ends the step
            # by its deadline.
            first = owed[0]
            left = first.arrival_time + first.ttft_slo_s * target - now
            # One past its SLO has missed it: holding the others back for it saves no one
            # (in a burst, that held every step to one short prompt).
            if left < math.inf and now < first.arrival_time + first.ttft_slo_s:
                ends = max(first.num_pending_tokens, tokens_within(left, kept))
                cap, owed_cap = min(cap, ends), min(owed_cap, ends)
        return StepGuard(cap=cap, owed=owed_cap, slo=slo, binder=binder,
                         deferred=frozenset(deferred))

    def _prompt_line(self, order: list[Request], waiting_order: list[Request],
                     now: float) -> list[tuple[list[Request], Request | None]]:
        """The prompts in the order :meth:`_fill` gives them prefill, in groups: for each
        prompt being prefilled (in ``order``), the waiting requests not placed yet that
        outrank it enough to preempt it, then that prompt; last, the other waiting
        requests, with None."""
        groups: list[tuple[list[Request], Request | None]] = []
        left = waiting_order
        for req in order:
            if req.status is not RequestStatus.RUNNING or req.num_pending_tokens <= 1:
                continue
            urgent, rest = [], []
            for r in left:
                (urgent if self.policy.preempts(r, req, now) else rest).append(r)
            groups.append((urgent, req))
            left = rest
        groups.append((left, None))
        return groups

    def _owed_need(self, line: list[Request], step_s: float, now: float) -> int:
        """Prefill tokens per step that serve ``line`` in order, each prompt by its TTFT
        deadline (``ttft_slo_s * tpot_slo_guard_target`` after arrival), in steps of
        ``step_s`` seconds: the largest ``ceil(T_i / max(1, floor(left_i / step_s)))``
        over the prompts ``i`` that can still meet their TTFT SLO, where ``T_i`` counts
        the pending tokens of ``i`` and of every prompt before it (earliest deadline
        first, as the policy orders them, so that serving the first prompt slowly cannot
        make those behind it miss). A prompt past its guard deadline but not its SLO
        (steps ran over) needs all of ``T_i`` now; one past its SLO has missed it already
        and is owed nothing more (spending others' credit on it would save no one)."""
        target = self.config.tpot_slo_guard_target
        ahead, need = 0, 0
        for req in line:
            ahead += req.num_pending_tokens
            if not now < req.arrival_time + req.ttft_slo_s < math.inf:
                continue
            left = req.arrival_time + req.ttft_slo_s * target - now
            need = max(need, math.ceil(ahead / max(1, math.floor(left / step_s))))
        return need

    def _tpot_credit(self, req: Request, now: float) -> float:
        """Seconds a decode's steps so far have banked (> 0) or owe (< 0) against its
        share of its TPOT SLO (``tpot_slo_guard_target * tpot_slo_s`` per token after the
        first); 0 before its first token."""
        if req.first_token_time is None:
            return 0.0
        share = req.tpot_slo_s * self.config.tpot_slo_guard_target
        return share * (len(req.output_token_ids) - 1) - (now - req.first_token_time)

    def _decode_limits(self, decoding: list[Request], now: float,
                       tail: float) -> tuple[float, Request, float, float]:
        """(tightest step-time limit, the request it belongs to, owed limit, lent limit)
        over ``decoding``, in seconds.

        A decode's TPOT credit is ``share * (g - 1) - (now - first_token_time)`` seconds
        after ``g`` output tokens, where ``share = target * tpot_slo_s``: what its steps so
        far have banked (or owe) against its share. Its limit spreads the credit over the
        ``r`` tokens it has left (up to ``max_tokens``): ``share + credit / r``, but at
        least ``share - (tpot_slo_s - share)``. Debt is repaid by at most the jitter
        headroom per step: debt that large comes from a preemption or a shed stretch, not
        from jitter, and repaying it faster would starve everyone's prefill (and let a
        batch request's debt squeeze interactive prompts). The stretch limit, ``share +
        credit`` (at least the limit), is the longest next step after which its mean TPOT
        so far still holds its share. The owed limit, what prompts owed their TTFT may
        spend by making decodes that they outrank sit out, is the tightest stretch limit
        but at least the tightest share. The lent limit, what they may spend beyond that
        (:attr:`StepGuard.owed`), adds part of each decode's later gaps' jitter headroom
        to its stretch limit: ``share + credit + OWED_BORROW * (tpot_slo_s - share) * (r -
        1)``, up to its full ``tpot_slo_s``. If every later step then ran at the share,
        its mean TPOT would end at most ``OWED_BORROW`` of the way from its share to its
        SLO; the steps after a burst, with no prefill queued, run well under the share.

        A decode in its last gap has no later step to average a slow one out (a 2-token
        output's TPOT is that one gap): its limit, which also bounds the owed and lent
        limits, is what is left of its full TPOT SLO, ``tpot_slo_s * g - (now -
        first_token_time)``, scaled by ``tail`` (the recent median over the worst
        measured / predicted step ratio, :meth:`StepTimeModel.worst_ratio`), with no
        floor, so that a step running as far over its prediction as 1% of steps do still
        ends in time. One that has already missed its SLO limits nothing more.
        """
        target = self.config.tpot_slo_guard_target
        limit, binder, stretch, lent = math.inf, decoding[0], math.inf, math.inf
        share_min, last_gap = math.inf, math.inf
        for req in decoding:
            if math.isinf(req.tpot_slo_s):
                continue  # no TPOT SLO (a bare Request): it limits nothing, and inf - inf is NaN
            share = req.tpot_slo_s * target
            credit = self._tpot_credit(req, now)
            gaps = req.max_tokens - len(req.output_token_ids)
            own = max(share + credit / max(1, gaps), 2 * share - req.tpot_slo_s)
            stretch_own = max(own, share + credit)
            stretch = min(stretch, stretch_own)
            lent = min(lent, max(stretch_own, min(
                req.tpot_slo_s,
                share + credit + OWED_BORROW * (req.tpot_slo_s - share) * (gaps - 1))))
            if gaps <= 1 and req.first_token_time is not None:
                left = req.tpot_slo_s * len(req.output_token_ids) - (now - req.first_token_time)
                if left > 0:  # else it has missed its SLO already: no step saves it
                    # No floor: a step held short for one gap costs one step's prefill,
                    # and at least a block of prefill still runs (the cap's floor).
                    own = min(own, left * tail)
                    last_gap = min(last_gap, own)
            if own < limit:
                limit, binder = own, req
            share_min = min(share_min, share)
        return (limit, binder, min(max(stretch, share_min), last_gap),
                min(max(lent, share_min), last_gap))

    def _allowance(self, req: Request, budget: PrefillBudget, now: float) -> int:
        """Prefill tokens ``req`` may take this step: the guard's cap for prompts its
        binding decode outranks, else what the prompts owed their TTFT may take
        (:attr:`StepGuard.owed`); a prompt earlier in line takes it first."""
        binder = self._guard.binder
        if binder is None or req.output_token_ids or self.policy.outranks(binder, req):
            return budget.capped
        return budget.owed

    def _admit(self, out: SchedulerOutput, waiting_order: list[Request],
               budget: PrefillBudget, now: float, slo: float = math.inf) -> None:
        """Admit waiting requests in ``waiting_order`` with their first chunks, taking
        their tokens from ``budget``."""
        policy, bm = self.policy, self.block_manager
        num_running = len(self.running)
        blocked_head: Request | None = None
        for req in waiting_order:
            if budget.total == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not policy.may_admit(req, num_running, len(self.waiting), now):
                continue
            if (self.step_time is not None
                    and req.tpot_slo_s * self.config.tpot_slo_guard_target >= slo
                    and self.step_time.predict(0, len(self.running) + 1) * self._step_ratio
                    > slo
                    and not policy.preempts(req, policy.pick_victim(self.running), now)):
                # The TPOT guard would shed it again at once. A request that outranks
                # running work is admitted: the guard sheds that work for it instead.
                continue
            n = self._chunk(req, self._allowance(req, budget, now))
            if n == 0:
                if budget.capped == 0 and budget.total > 0:
                    continue  # the cap is spent; a later prompt may be owed more for its TTFT
                break
            if not bm.can_allocate(req.request_id, n):
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
            bm.allocate(req.request_id, n)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            policy.on_admit(req, now)
            out.seqs.append(ScheduledSeq(req, 0, n))
            budget.take(n)

    def _preempt_for_urgent(self, out: SchedulerOutput, waiting_order: list[Request],
                            now: float) -> None:
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
                len(self.running) + seats > self.config.max_num_seqs
                or bm.num_free_blocks < blocks
            ):
                victim = self.policy.pick_victim(self.running)
                if not self.policy.preempts(req, victim, now):
                    return
                self.preempt(victim)
                out.preempted.append(victim)
            if len(self.running) + seats > self.config.max_num_seqs or bm.num_free_blocks < blocks:
                return

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of ``req``'s prefill that fit this step's remaining ``budget``."""
        pending = req.num_pending_tokens
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
            candidates = [
                r for r in self.running if r.request_id not in scheduled and r is not req
            ]
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
            sampled: request id -> token id for each request whose chunk sampled.

        Returns:
            The requests that received a new token, in ``out.seqs`` order.
        """
        got_token = []
        for seq in out.seqs:
            req = seq.request
            req.num_computed_tokens = seq.start + seq.num_tokens
            if seq.samples:
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
