"""The TPOT SLO guard: each step's plan for prefill caps, lending and shedding.

Sarathi-Serve derives a fixed token budget from a TPOT SLO (Agrawal et al., OSDI 2024,
section 4.3). The guard does that per step, from the step-time model's prediction
(:mod:`policies.step_time`) and each running request's own SLO and progress, and it
returns a :class:`GuardPlan`. The scheduler applies the plan: it alone preempts, admits
and allocates KV blocks. Pure Python, no torch; requests are read through their
attributes (the engine's ``Request`` has them all).

The rules, each with its reason (:meth:`TpotGuard.plan` has the detail):

=================  ==========================================================================
rule               why
=================  ==========================================================================
shed               a decode whose step would break a more urgent decode's limit yields to it
                   (``policy.outranks``): batch work gives way to interactive work
cap                prefill per step stays within every kept decode's step-time limit
credit             TPOT is a mean over the output: time banked by fast steps lets later
                   steps take longer chunks, and a slow step is paid back by the next ones
owed               prompts the binding decode does not outrank are owed their TTFT SLO and
                   may take more than the cap, as far as the decodes' credit allows
lend               beyond that, up to ``OWED_BORROW`` of each decode's later jitter headroom
sit out            a decode with credit to spare skips a step for an owed prompt (keeps KV)
last gap           a decode in its last gap has no later step to average a slow one out
deadline           in the step that ends the first owed prompt's prefill, later prompts add
                   only what still ends the step by its TTFT deadline
=================  ==========================================================================

Each rule can be switched off alone (``rules_off``, by the names in :data:`RULES`), so
that ``iterserve simulate --ablate`` can measure what each one earns.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from policies.base import SchedulingPolicy
from policies.step_time import StepTimeModel

RULES = ("shed", "cap", "credit", "owed", "lend", "sit_out", "last_gap", "deadline")
"""The rules of the table above, as ``rules_off`` names them. Off: ``shed`` never sheds;
``cap`` leaves prefill uncapped; ``credit`` counts no banked time or debt (every decode's
limit is its share); ``owed`` owes no prompt its TTFT (so nothing is lent, sits out or is
held to a deadline); ``lend`` lends no later headroom; ``sit_out`` keeps every decode;
``last_gap`` treats the last gap like the others; ``deadline`` lets later prompts fill the
step that ends the first owed prompt's prefill."""

ACTS = ("shed", "sit_out", "last_gap", "deadline")
"""The rules whose action in a plan is discrete, and counted in ``TpotGuard.acted``: a
plan sheds a decode, has a decode sit out, lowers a decode's limit for its last gap, or
holds the step to the first owed prompt's TTFT deadline."""

OWED_BORROW = 0.5
"""Fraction of a decode's later gaps' jitter headroom (``tpot_slo_s`` minus its share, per
gap) that prompts owed their TTFT may spend in one step (:meth:`TpotGuard._decode_limits`)."""

Req = Any
"""A running or waiting request: ``request_id``, ``priority``, ``arrival_time``,
``tpot_slo_s``, ``ttft_slo_s``, ``num_pending_tokens``, ``output_token_ids``,
``first_token_time``, ``max_tokens`` (the engine's ``Request``)."""


@dataclass(slots=True)
class GuardPlan:
    """One step's TPOT guard; the defaults: guard off."""

    cap: float = math.inf
    """Prefill tokens any prompt may take."""
    owed: float = math.inf
    """Prefill tokens (at least ``cap``) the prompts that ``binder`` does not outrank may
    take, to meet their TTFT SLOs."""
    slo: float = math.inf
    """Tightest shedding limit, seconds."""
    lent_s: float = math.inf
    """The lent limit of :meth:`TpotGuard._decode_limits` in the step-time model's own
    seconds (before the measured / predicted correction): the longest step the decodes
    lend prompts owed their TTFT. The replica reports it to admission."""
    binder: Req | None = None
    """The decode whose step-time limit binds; None when no decode has a TPOT SLO."""
    deferred: frozenset[str] = frozenset()
    """Ids of decodes that sit this step out, keeping their KV."""
    shed: tuple[Req, ...] = ()
    """Running requests to preempt for more urgent decodes, in that order."""


@dataclass(frozen=True, slots=True)
class _Limits:
    """Step-time limits over the decodes, in seconds (:meth:`TpotGuard._decode_limits`)."""

    tightest: float
    binder: Req
    owed: float
    lent: float


def prefill_within(
    coefficients: tuple[float, float, float], limit_s: float, decodes: int, ratio: float = 1.0
) -> float:
    """Prefill tokens that keep a step with ``decodes`` decodes within ``limit_s`` seconds
    under the step-time model ``(a, b, c)`` (:mod:`policies.step_time`) scaled by ``ratio``
    (the measured / predicted correction); inf when a prefill token costs nothing, negative
    when the decodes alone break the limit. The guard's caps and admission's model of them
    both come from here."""
    a, b, c = coefficients
    spare = limit_s - (a + c * decodes) * ratio
    return math.floor(spare / (b * ratio)) if b > 0 else math.inf


def prompt_line(
    order: Sequence[Req],
    waiting_order: Sequence[Req],
    now: float,
    policy: SchedulingPolicy,
    prefilling: Callable[[Req], bool],
) -> list[tuple[list[Req], Req | None]]:
    """The prompts in the order the scheduler gives them prefill, in groups: for each
    prompt being prefilled (in ``order``, where ``prefilling`` holds), the waiting
    requests not placed yet that outrank it enough to preempt it, then that prompt; last,
    the other waiting requests, with None."""
    groups: list[tuple[list[Req], Req | None]] = []
    left = list(waiting_order)
    for req in order:
        if not prefilling(req):
            continue
        urgent, rest = [], []
        for r in left:
            (urgent if policy.preempts(r, req, now) else rest).append(r)
        groups.append((urgent, req))
        left = rest
    groups.append((left, None))
    return groups


class TpotGuard:
    """Plans each step so that the running requests keep their TPOT SLOs.

    Args:
        policy: the scheduling policy (``outranks`` and ``preempts`` decide precedence).
        model: the step-time model its predictions come from.
        target: ``tpot_slo_guard_target``, the fraction of a TPOT SLO steps aim at.
        block_size: KV block size; at least one block of prefill runs per step.
        max_num_batched_tokens: the step's token budget.
        rules_off: names from :data:`RULES` to switch off (ablation studies).

    Raises:
        ValueError: an unknown rule name.
    """

    def __init__(
        self,
        policy: SchedulingPolicy,
        model: StepTimeModel,
        *,
        target: float,
        block_size: int,
        max_num_batched_tokens: int,
        rules_off: frozenset[str] = frozenset(),
    ) -> None:
        unknown = set(rules_off) - set(RULES)
        if unknown:
            raise ValueError(f"unknown TPOT guard rules {sorted(unknown)}; known: {RULES}")
        self.off = frozenset(rules_off)
        self.policy = policy
        self.model = model
        self.target = target
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.ratio = 1.0
        """This step's ``StepTimeModel.local_ratio``, read once per plan."""
        self.acted: Counter[str] = Counter()
        """Plans each rule of :data:`ACTS` changed, by rule name. A rule that never
        changes a plan earns nothing (``bench/results/experiments/guard_acts.json`` counted it)."""

    def sheds_at_once(self, req: Req, num_running: int, slo: float) -> bool:
        """Whether admitting waiting ``req`` now would only have it shed next step: its
        SLO is no tighter than this step's shedding limit ``slo`` and one more decode
        already breaks that limit. Never with ``shed`` off: the gate is the admission
        side of shedding, and without it nothing would shed the request."""
        return (
            "shed" not in self.off
            and req.tpot_slo_s * self.target >= slo
            and self.model.predict(0, num_running + 1) * self.ratio > slo
        )

    def plan(
        self,
        order: Sequence[Req],
        waiting_order: Sequence[Req],
        now: float,
        prefilling: Callable[[Req], bool],
    ) -> GuardPlan:
        """This step's plan (see the module's table of rules).

        Shedding: walks the running requests most urgent first (``order``), tracking the
        tightest step-time limit so far among those decoding (a TPOT SLO times
        ``target``); a request whose decode would push the predicted decode-only step
        time past that limit is shed if the limit's owner outranks it.

        Capping: the step's prefill tokens are capped so the predicted step time stays
        within every kept decode's limit (:meth:`_decode_limits`), at least one block.
        Predictions are scaled by the model's recent measured / predicted ratio
        (``StepTimeModel.local_ratio``), which corrects the global linear fit where the
        engine runs now, in both directions.

        TTFT: prompts the binding decode does not outrank are owed their TTFT SLOs too.
        They may take more than the cap, up to the lent limit, all of it rather than
        what just meets their deadlines. When that, or the token budget, cannot serve
        them, in line, by their deadlines (:meth:`_owed_need`, counting steps at the full
        TPOT SLO, since steps run over their predictions, or at a full token budget's
        time where that is shorter), decodes that the first owed prompt could preempt
        sit the step out, least urgent first, when their TPOT credit covers a step
        without a token. In the step that ends the first owed prompt's prefill, the
        prompts behind it take only what still ends the step by its TTFT deadline,
        unless it has already missed its TTFT SLO.

        Args:
            order: running requests, most urgent first.
            waiting_order: waiting requests, in the policy's order.
            prefilling: whether a running request is still prefilling (its status is
                running and more than one token is pending).
        """
        model, target = self.model, self.target
        self.ratio = ratio = model.local_ratio()
        slo, owner, decoding, shed = math.inf, None, [], []
        for req in order:
            # A request's TPOT SLO binds once it decodes; while it prefills, the prefill
            # budget should go to its TTFT instead.
            is_decoding = req.num_pending_tokens == 1
            if req.tpot_slo_s * target < slo and is_decoding:
                slo, owner = req.tpot_slo_s * target, req
            if (
                "shed" not in self.off
                and owner is not req
                and model.predict(0, len(decoding) + 1) * ratio > slo
                and self.policy.outranks(owner, req)
            ):
                shed.append(req)
                continue
            if is_decoding:
                decoding.append(req)
        self.acted["shed"] += bool(shed)
        if math.isinf(slo):
            return GuardPlan(shed=tuple(shed))
        limits = self._decode_limits(decoding, now, ratio / model.worst_ratio())
        owed = self._owed(order, waiting_order, now, prefilling, shed, limits.binder)
        cap, owed_cap, deferred = self._caps(decoding, owed, limits, slo, now)
        if "cap" in self.off:
            cap = owed_cap = math.inf
        return GuardPlan(
            cap=cap,
            owed=owed_cap,
            slo=slo,
            binder=limits.binder,
            lent_s=limits.lent / ratio,
            deferred=frozenset(deferred),
            shed=tuple(shed),
        )

    def _owed(
        self,
        order: Sequence[Req],
        waiting_order: Sequence[Req],
        now: float,
        prefilling: Callable[[Req], bool],
        shed: list[Req],
        binder: Req,
    ) -> list[Req]:
        """Prompts owed their TTFT SLO, in line: those ``binder`` does not outrank."""
        if "owed" in self.off:
            return []
        shed_ids = {r.request_id for r in shed}
        line = prompt_line(
            order,
            waiting_order,
            now,
            self.policy,
            lambda r: r.request_id not in shed_ids and prefilling(r),
        )
        return [
            r
            for urgent, req in line
            for r in (*urgent, req)
            if r is not None and not r.output_token_ids and not self.policy.outranks(binder, r)
        ]

    def _tokens_within(self, limit: float, decodes: int) -> float:
        """Prefill tokens that keep a step with ``decodes`` decodes within ``limit`` s."""
        return prefill_within(self.model.coefficients(), limit, decodes, self.ratio)

    def _caps(
        self, decoding: list[Req], owed: list[Req], limits: _Limits, slo: float, now: float
    ) -> tuple[float, float, set[str]]:
        """(cap, owed cap, ids of decodes that sit out) for this step."""
        target, ratio = self.target, self.ratio
        # The TTFT plan counts steps at the full SLO, not at the guard's target: steps run
        # over their prediction by the jitter that headroom is for (a tenth at the median,
        # a third at the 95th percentile on this CPU), and a plan that spends the TTFT
        # headroom on it finishes late. A step is no longer than a full token budget's,
        # whatever the SLO allows (a batch decode's limit is seconds).
        max_tokens = self.max_num_batched_tokens
        full_s = self.model.predict(max_tokens - len(decoding), len(decoding)) * ratio
        need = self._owed_need(owed, min(max(limits.tightest, slo), full_s) / target, now)
        kept, deferred = len(decoding), set()
        for req in reversed(decoding):  # least urgent first
            # Sitting out frees step time and a budget token: it helps while either binds.
            if (
                "sit_out" in self.off
                or not owed
                or need <= min(max_tokens - kept, self._tokens_within(limits.owed, kept))
            ):
                break
            if not self.policy.preempts(owed[0], req, now):
                break  # the rest are at least as urgent
            if self._tpot_credit(req, now) >= min(limits.owed, full_s):
                deferred.add(req.request_id)
                kept -= 1
        self.acted["sit_out"] += bool(deferred)
        cap = max(self.block_size, self._tokens_within(limits.tightest, kept))
        # Sitting out is sized by the owed limit alone: a shorter step serves a prompt
        # that ends its prefill in it sooner. Owed prompts take all the decodes lend, not
        # just what meets their deadlines: an earlier first token leaves margin for steps
        # that run over, and clears the queue that later arrivals (and admission's
        # predictions for them) wait behind.
        # (need is 0 when no owed prompt can still meet a TTFT SLO: none is stretched for.)
        owed_cap = max(cap, self._tokens_within(limits.lent, kept)) if need > 0 else cap
        if (
            "deadline" not in self.off
            and owed
            and owed[0].num_pending_tokens <= min(owed_cap, max_tokens - kept)
        ):
            # The first prompt in line samples its first token when this step ends: the
            # prompts behind it (later deadlines) may add only what still ends the step
            # by its deadline.
            first = owed[0]
            left = first.arrival_time + first.ttft_slo_s * target - now
            # One past its SLO has missed it: holding the others back for it saves no one
            # (in a burst, that held every step to one short prompt).
            if left < math.inf and now < first.arrival_time + first.ttft_slo_s:
                ends = max(first.num_pending_tokens, self._tokens_within(left, kept))
                self.acted["deadline"] += ends < owed_cap
                cap, owed_cap = min(cap, ends), min(owed_cap, ends)
        return cap, owed_cap, deferred

    def _owed_need(self, line: list[Req], step_s: float, now: float) -> int:
        """Prefill tokens per step that serve ``line`` in order, each prompt by its TTFT
        deadline (``ttft_slo_s * target`` after arrival), in steps of ``step_s`` seconds:
        the largest ``ceil(T_i / max(1, floor(left_i / step_s)))`` over the prompts ``i``
        that can still meet their TTFT SLO, where ``T_i`` counts the pending tokens of
        ``i`` and of every prompt before it (earliest deadline first, as the policy orders
        them, so that serving the first prompt slowly cannot make those behind it miss).
        A prompt past its guard deadline but not its SLO (steps ran over) needs all of
        ``T_i`` now; one past its SLO has missed it already and is owed nothing more
        (spending others' credit on it would save no one)."""
        ahead, need = 0, 0
        for req in line:
            ahead += req.num_pending_tokens
            if not now < req.arrival_time + req.ttft_slo_s < math.inf:
                continue
            left = req.arrival_time + req.ttft_slo_s * self.target - now
            need = max(need, math.ceil(ahead / max(1, math.floor(left / step_s))))
        return need

    def _tpot_credit(self, req: Req, now: float) -> float:
        """Seconds a decode's steps so far have banked (> 0) or owe (< 0) against its
        share of its TPOT SLO (``target * tpot_slo_s`` per token after the first); 0
        before its first token."""
        if req.first_token_time is None or "credit" in self.off:
            return 0.0
        share = req.tpot_slo_s * self.target
        return share * (len(req.output_token_ids) - 1) - (now - req.first_token_time)

    def _decode_limits(self, decoding: list[Req], now: float, tail: float) -> _Limits:
        """The step-time limits over ``decoding``.

        A decode's TPOT credit is ``share * (g - 1) - (now - first_token_time)`` seconds
        after ``g`` output tokens, where ``share = target * tpot_slo_s``. Its limit spreads
        the credit over the ``r`` tokens it has left (up to ``max_tokens``): ``share +
        credit / r``, but at least ``share - (tpot_slo_s - share)``: debt is repaid by at
        most the jitter headroom per step (debt that large comes from a preemption or a
        shed stretch, not from jitter, and repaying it faster would starve everyone's
        prefill). ``tightest`` is the smallest limit and ``binder`` its decode. The stretch
        limit, ``share + credit`` (at least the limit), is the longest next step after
        which its mean TPOT so far still holds its share; ``owed``, what owed prompts may
        spend by making decodes sit out, is the tightest stretch limit but at least the
        tightest share. ``lent``, what they may spend beyond that, adds part of each
        decode's later gaps' headroom: ``share + credit + OWED_BORROW * (tpot_slo_s -
        share) * (r - 1)``, up to its full ``tpot_slo_s``.

        A decode in its last gap has no later step to average a slow one out: its limit,
        which also bounds ``owed`` and ``lent``, is what is left of its full TPOT SLO,
        ``tpot_slo_s * g - (now - first_token_time)``, scaled by ``tail`` (the recent
        median over the worst measured / predicted step ratio), with no floor. One that
        has already missed its SLO limits nothing more.
        """
        target = self.target
        limit, binder, stretch, lent = math.inf, decoding[0], math.inf, math.inf
        share_min, last_gap, lowered = math.inf, math.inf, set()
        for req in decoding:
            if math.isinf(req.tpot_slo_s):
                continue  # no TPOT SLO: it limits nothing, and inf - inf is NaN
            share = req.tpot_slo_s * target
            credit = self._tpot_credit(req, now)
            gaps = req.max_tokens - len(req.output_token_ids)
            own = max(share + credit / max(1, gaps), 2 * share - req.tpot_slo_s)
            stretch_own = max(own, share + credit)
            stretch = min(stretch, stretch_own)
            borrow = 0.0 if "lend" in self.off else OWED_BORROW
            lent = min(
                lent,
                max(
                    stretch_own,
                    min(
                        req.tpot_slo_s,
                        share + credit + borrow * (req.tpot_slo_s - share) * (gaps - 1),
                    ),
                ),
            )
            if gaps <= 1 and req.first_token_time is not None and "last_gap" not in self.off:
                left = req.tpot_slo_s * len(req.output_token_ids) - (now - req.first_token_time)
                if left > 0:  # else it has missed its SLO already: no step saves it
                    # No floor: a step held short for one gap costs one step's prefill,
                    # and at least a block of prefill still runs (the cap's floor).
                    if left * tail < own:
                        own = left * tail
                        lowered.add(req.request_id)
                    last_gap = min(last_gap, own)
            if own < limit:
                limit, binder = own, req
            share_min = min(share_min, share)
        stretch, lent = max(stretch, share_min), max(lent, share_min)
        self.acted["last_gap"] += (
            binder.request_id in lowered or last_gap < stretch or last_gap < lent
        )
        return _Limits(limit, binder, min(stretch, last_gap), min(lent, last_gap))
