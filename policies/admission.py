"""SLO-aware admission: predict a request's latency on a replica, then admit, hold or reject.

The objective is goodput in DistServe's sense (Zhong et al., OSDI 2024): the rate of
requests that meet their TTFT and TPOT SLOs. Admitting a request that cannot meet its SLO
spends capacity that other requests needed to meet theirs, so under overload admission
holds requests briefly (``Wait``) and then sheds them (``Reject`` with a Retry-After)
rather than let every queue grow.

The latency model is ours. A step is the budgeted mixed step of Sarathi-Serve (Agrawal
et al., OSDI 2024, section 4): every running request decodes one token, and prefill chunks
fill the rest of a token budget (``max_num_batched_tokens``). Its time is modelled as
linear, ``a + b * prefill_tokens + c * decode_seqs`` seconds (``policies.step_time``,
fitted online on the replica). From a replica's load (``policies.load.LoadSnapshot``),
:class:`AdmissionController` predicts a new request's TTFT as the time to prefill the
tokens queued ahead of it plus its own prompt, and the TPOT that running requests would
see while that prefill drains.

Pure Python, no torch: the router imports it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from policies.base import SchedulingPolicy
from policies.decision import Admit, Decision, Prediction, Reject, Wait
from policies.load import LoadSnapshot
from policies.priority import DEFAULT_CLASSES, PriorityPolicy, TrafficClass
from policies.slo_guard import prefill_within


@dataclass(frozen=True, slots=True)
class _Rank:
    """A stand-in request of one priority, for asking the policy about precedence."""

    priority: int


@dataclass(frozen=True, slots=True)
class _Load:
    """A snapshot's totals as seen by a request of one priority."""

    tokens_ahead: int
    requests_ahead: int
    running_before: int
    tokens_total: int
    """Queued prefill tokens of every class: what fills each step's token budget."""
    reclaimable_blocks: int
    """KV blocks of running requests of classes served after it (preemptible)."""
    tpot_slos: tuple[float, ...]
    """TPOT SLOs of the classes with running requests (known classes only)."""
    owed: bool
    """No running class outranks the request (unknown classes might): the TPOT guard owes
    it its TTFT SLO."""


class AdmissionController:
    """Admit, hold or reject a request for a replica so that SLOs are met (see module doc).

    The model of one replica under a request of class ``k`` with priority ``p``:

    * Ahead of it: the queued prefill tokens and requests of classes it does not outrank
      (``policy.outranks``: under the priority policy, classes whose
      ``default_priority <= p``, since less urgent queued work does not delay it; under
      FCFS nothing outranks anything, so all queued work is ahead).
      Classes unknown to the controller count as ahead (conservative).
    * Each step decodes every running request (``d``) and prefills up to
      ``m = min(budget - d, cap)`` tokens (at least 1), where ``cap`` is what the
      replica's TPOT guard allows (``LoadSnapshot.tpot_slo_guard``, priority scheduling:
      the prefill that keeps ``a + c * d + b * m`` within the tightest running TPOT SLO
      times ``tpot_slo_guard_target``), else unbounded. A request that no running class
      outranks is owed its TTFT SLO by the guard (``policies.slo_guard``), which lets
      its prefill fill steps up to the full TPOT SLO (target 1), and under a policy that
      orders by priority makes less urgent decodes sit steps out for it, so its ``d``
      counts only the running requests served before it. Its first step may also take
      what the guard lends owed prompts from the decodes' banked TPOT credit
      (``LoadSnapshot.owed_step_s``): ``m1 >= m`` tokens, the prefill that fits that
      time; otherwise ``m1 = m``. Prefilling ``x`` tokens ahead plus the prompt ``P``
      takes ``n = 1 + ceil((x + P - m1) / m)`` steps, and ``TTFT = r + n * (a + c * d)
      + b * min(m1 + (n - 1) * m, max(x + P, X))``: ``r`` is what is left of the step
      in flight (``LoadSnapshot.step_left_s``; a request joins the next step), and
      ``X``, the queued tokens of every class, fills those steps' budgets (under the
      priority policy less urgent prefill does not go first, but it shares each step).
    * TPOT of the running requests (and of the new one): the mean step time while that
      prefill drains, ``a + b * (x + P) / max(n, H) + c * (d + 1)``. Amortising over at
      least ``H = tpot_horizon_steps`` steps reflects that TPOT is a mean over a
      request's output: one short prompt's chunk is one slow step among many, while a
      backlog of ``H`` or more steps makes every step a full budget for a long stretch.
      Without the guard it is at least the measured ``recent_step_s``: steps already
      slower than the SLO stay so, whatever this request adds. With the guard and FCFS,
      prefill is capped but nothing is shed: ``d`` counts every running request and the
      tightest SLO running binds. With the guard and a policy that orders by priority
      (``policy.by_priority``), ``d`` counts only running requests served before this one
      and the SLO is its own: the guard sheds less urgent decodes for it, and its decodes
      for more urgent ones.
    * Seats: the running requests of classes that go before it plus the requests queued
      ahead plus this one must fit ``max_num_seqs`` (less urgent running requests can be
      preempted by the priority policy); else its TTFT hangs on decodes finishing, which
      the model cannot predict.
    * KV: ``ceil((x + P) / block_size) + 1`` blocks (one block of decode headroom) must be
      free, counting blocks of classes it outranks as free (the policy can preempt them).

    The TTFT budget is the SLO minus ``waited_s`` (the SLO counts from arrival). A
    prediction must fit ``slo_margin`` times its budget or SLO: the rest absorbs
    prediction error (``python -m bench.scheduling`` reports it against the SLOs). An SLO
    the request could not meet even on an idle replica (a very long prompt) is replaced by
    what an idle replica would achieve, so an idle replica always admits.

    Args:
        classes: traffic classes by name.
        policy: the replicas' scheduling policy (``EngineConfig.make_policy``); asked
            which classes go first. None: the priority policy, the server's default.
        tpot_horizon_steps: ``H`` above, in steps.
        slo_margin: fraction (0, 1] of the TTFT budget and the TPOT SLO that predictions
            must fit.

    Raises:
        ValueError: ``tpot_horizon_steps`` < 1 or ``slo_margin`` outside (0, 1].
    """

    def __init__(
        self,
        classes: Mapping[str, TrafficClass] = DEFAULT_CLASSES,
        *,
        policy: SchedulingPolicy | None = None,
        tpot_horizon_steps: int = 32,
        slo_margin: float = 0.85,
    ) -> None:
        if tpot_horizon_steps < 1:
            raise ValueError(f"tpot_horizon_steps={tpot_horizon_steps!r}: must be >= 1")
        if not 0 < slo_margin <= 1:
            raise ValueError(f"slo_margin={slo_margin!r}: must be in (0, 1]")
        self.classes = dict(classes)
        self.policy = policy if policy is not None else PriorityPolicy()
        self.tpot_horizon_steps = tpot_horizon_steps
        self.slo_margin = slo_margin

    def _class(self, name: str) -> TrafficClass:
        try:
            return self.classes[name]
        except KeyError:
            raise ValueError(
                f"unknown traffic class {name!r}; known: {sorted(self.classes)}"
            ) from None

    def _goes_before(self, name: str, priority: int) -> bool:
        """Whether class ``name``'s work is served before a request of ``priority``: the
        policy does not rank the request above the class (unknown classes: ahead)."""
        if name not in self.classes:
            return True
        return not self.policy.outranks(_Rank(priority), _Rank(self.classes[name].default_priority))

    # -- the model ---------------------------------------------------------------------

    def _ttft(
        self,
        s: LoadSnapshot,
        tokens: int,
        d: int,
        *,
        total: int = 0,
        cap: tuple[float, float] = (math.inf, math.inf),
        residual_s: float = 0.0,
    ) -> tuple[float, int]:
        """(seconds, steps) to prefill ``tokens`` alongside ``d`` decodes.

        Steps take at most ``cap`` prefill tokens (the TPOT guard's: the first step's,
        then each later one's) and are filled up to their budget from ``total`` queued
        tokens (less urgent work included: it shares the steps it does not delay).
        ``residual_s``: the step in flight, which a new request cannot join.
        """
        a, b, c = s.step_coefficients
        first, per_step = (max(1, min(s.max_num_batched_tokens - d, m)) for m in cap)
        steps = 1 + max(0, math.ceil((tokens - first) / per_step))
        executed = min(first + (steps - 1) * per_step, max(tokens, total))
        return residual_s + steps * (a + c * d) + b * executed, steps

    def _tpot(
        self, s: LoadSnapshot, tokens: int, d: int, cap: tuple[float, float] = (math.inf, math.inf)
    ) -> float:
        _, steps = self._ttft(s, tokens, d, cap=cap)
        return s.step_time(tokens / max(steps, self.tpot_horizon_steps), d + 1)

    def _guard_cap(self, s: LoadSnapshot, load: _Load, d: int) -> tuple[float, float]:
        """Prefill tokens the replica's TPOT guard allows in the first step and in each
        later one (inf: no guard)."""
        if not (s.tpot_slo_guard and load.tpot_slos):
            return math.inf, math.inf
        target = 1.0 if load.owed else s.tpot_slo_guard_target
        limit = min(load.tpot_slos) * target
        cap = max(s.block_size, prefill_within(s.step_coefficients, limit, d))
        if not load.owed or s.owed_step_s <= limit:
            return cap, cap
        # The decodes lend an owed prompt their banked credit, which one long step spends.
        return max(cap, prefill_within(s.step_coefficients, s.owed_step_s, d)), cap

    def _kv_fits(self, s: LoadSnapshot, tokens: int, reclaimable: int) -> bool:
        return math.ceil(tokens / s.block_size) + 1 <= s.num_kv_blocks_free + reclaimable

    def _load(self, s: LoadSnapshot, priority: int) -> _Load:
        before = {
            k
            for k in {
                *s.waiting_prefill_tokens,
                *s.waiting_requests,
                *s.running_seqs,
                *s.kv_blocks_used,
            }
            if self._goes_before(k, priority)
        }
        return _Load(
            tokens_ahead=sum(n for k, n in s.waiting_prefill_tokens.items() if k in before),
            requests_ahead=sum(n for k, n in s.waiting_requests.items() if k in before),
            running_before=sum(n for k, n in s.running_seqs.items() if k in before),
            tokens_total=sum(s.waiting_prefill_tokens.values()),
            reclaimable_blocks=sum(n for k, n in s.kv_blocks_used.items() if k not in before),
            tpot_slos=tuple(
                self.classes[k].tpot_slo_s
                for k, n in s.running_seqs.items()
                if n > 0 and k in self.classes
            ),
            # A running class unknown here might outrank it (conservative, as above).
            owed=not any(
                k not in self.classes
                or self.policy.outranks(_Rank(self.classes[k].default_priority), _Rank(priority))
                for k, n in s.running_seqs.items()
                if n > 0
            ),
        )

    def _predict_at(
        self, s: LoadSnapshot, cls: TrafficClass, load: _Load, tokens_ahead: int, prompt_tokens: int
    ) -> Prediction:
        """The prediction with ``tokens_ahead`` queued ahead instead of the snapshot's."""
        d = s.total_running
        if s.tpot_slo_guard and self.policy.by_priority and load.owed:
            # The guard's sit-out rule: less urgent decodes skip steps for an owed prompt.
            d = load.running_before
        tokens = tokens_ahead + prompt_tokens
        cap = self._guard_cap(s, load, d)
        total = load.tokens_total - load.tokens_ahead + tokens
        ttft, steps = self._ttft(s, tokens, d, total=total, cap=cap, residual_s=s.step_left_s)
        if s.tpot_slo_guard and self.policy.by_priority:
            # The replica's TPOT guard sheds less urgent decodes for this request's SLO
            # and sheds this request's decodes for more urgent ones' SLOs: only the
            # requests served before it, and its own SLO, matter.
            tpot = self._tpot(s, tokens, load.running_before, cap)
            tpot_slo = cls.tpot_slo_s
        elif s.tpot_slo_guard:
            # FCFS never sheds: every running decode stays, and the guard holds steps to
            # the tightest SLO running by capping prefill.
            tpot = self._tpot(s, tokens, d, cap)
            tpot_slo = min([cls.tpot_slo_s, *load.tpot_slos])
        else:
            # Without the guard, steps already slower than the SLO stay so whatever the
            # model says of this request's share: the measured step time is a floor.
            tpot = max(self._tpot(s, tokens, d), s.recent_step_s)
            tpot_slo = min([cls.tpot_slo_s, *load.tpot_slos])
        return Prediction(
            ttft_s=ttft,
            tpot_s=tpot,
            tpot_slo_s=tpot_slo,
            tokens_ahead=tokens_ahead,
            requests_ahead=load.requests_ahead,
            steps=steps,
            seats_free=load.running_before + load.requests_ahead + 1 <= s.max_num_seqs,
            kv_fits=self._kv_fits(s, tokens, load.reclaimable_blocks),
        )

    def predict(
        self,
        snapshot: LoadSnapshot,
        traffic_class: str,
        prompt_tokens: int,
        priority: int | None = None,
    ) -> Prediction:
        """Predicted latency of a request if admitted to ``snapshot``'s replica now.

        Args:
            traffic_class: the request's class name.
            prompt_tokens: its prompt length in tokens.
            priority: its priority; None: its class's default.

        Raises:
            ValueError: unknown class or negative ``prompt_tokens``.
        """
        cls = self._class(traffic_class)
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens={prompt_tokens!r}: must be >= 0")
        p = cls.default_priority if priority is None else priority
        load = self._load(snapshot, p)
        return self._predict_at(snapshot, cls, load, load.tokens_ahead, prompt_tokens)

    # -- the decision ------------------------------------------------------------------

    def decide(
        self,
        snapshot: LoadSnapshot,
        traffic_class: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        waited_s: float,
    ) -> Decision:
        """Admit, Wait or Reject a request of ``traffic_class`` for ``snapshot``'s replica.

        Admit when the predicted TTFT fits ``slo_margin`` of the class's TTFT SLO less
        ``waited_s``, the predicted TPOT fits ``slo_margin`` of the tightest TPOT SLO
        involved, and seats and KV suffice.
        A class that is not rejectable, once even an idle replica would miss its TTFT
        SLO, is admitted on seats, KV and TPOT alone.
        Otherwise, at the class's ``hard_queue_cap``: Reject. Else, before
        ``max_queue_wait_s`` and while its TTFT SLO is still within reach
        (:meth:`_lost`): Wait for the rest of it. Else Reject a rejectable class,
        with a Retry-After of the predicted time until the queue ahead has drained enough
        to admit a fresh request (at least 1 s, whole seconds; assumes nothing more urgent
        arrives meanwhile); a non-rejectable class Waits again, for its ``max_queue_wait_s``.

        Args:
            prompt_tokens: the request's prompt length in tokens.
            max_tokens: its output tokens at most (not used by the model: the engine
                admits on prompt blocks and preempts when decodes outgrow the cache).
            priority: its priority (lower is more urgent).
            waited_s: seconds since it arrived (held by ``Wait`` decisions included).

        Raises:
            ValueError: unknown class, or a negative count or time.
        """
        cls = self._class(traffic_class)
        if waited_s < 0 or max_tokens < 0 or prompt_tokens < 0:
            raise ValueError(
                f"prompt_tokens={prompt_tokens!r}, max_tokens={max_tokens!r}, "
                f"waited_s={waited_s!r}: must be >= 0"
            )
        s = snapshot
        load = self._load(s, priority)
        pred = self._predict_at(s, cls, load, load.tokens_ahead, prompt_tokens)
        failed = self._failures(s, pred, prompt_tokens, cls.ttft_slo_s - waited_s)
        if failed and not cls.rejectable and self._out_of_reach(s, cls, prompt_tokens, waited_s):
            # Work that must run, whose TTFT SLO even an idle replica would now miss: the
            # TTFT test would admit it only at an idle replica, starving it under steady
            # load. It goes as soon as seats, KV and the running decodes' TPOT allow.
            failed = [f for f in failed if f[0] != "ttft"]
        if not failed:
            return Admit()
        reason = f"{cls.name}: " + "; ".join(text for _, text in failed)
        cap = cls.hard_queue_cap
        if cap is not None and s.waiting_requests.get(cls.name, 0) >= cap:
            return Reject(
                self._retry_after(s, cls, load, prompt_tokens),
                f"{cls.name}: queue at its cap of {cap} requests",
                "queue_cap",
            )
        if waited_s < cls.max_queue_wait_s and not self._lost(s, cls, prompt_tokens, waited_s):
            return Wait(cls.max_queue_wait_s - waited_s, reason)
        if cls.rejectable:
            return Reject(self._retry_after(s, cls, load, prompt_tokens), reason, failed[0][0])
        # Held again and re-decided as loads change: a drain estimate would only bound the
        # hold, and its search cost grew with every held request's every re-decision.
        return Wait(cls.max_queue_wait_s, reason)

    def _out_of_reach(
        self, s: LoadSnapshot, cls: TrafficClass, prompt_tokens: int, waited_s: float
    ) -> bool:
        """Even an idle replica would now miss the margin of what is left of the TTFT SLO."""
        idle_ttft, _ = self._ttft(s, prompt_tokens, 0)
        return idle_ttft > self.slo_margin * (cls.ttft_slo_s - waited_s)

    def _lost(
        self, s: LoadSnapshot, cls: TrafficClass, prompt_tokens: int, waited_s: float
    ) -> bool:
        """A held request past its TTFT SLO's point of no return (even an idle replica
        would miss the margin of what is left): holding it longer only delays the later
        arrivals that count it as queued ahead. One out of reach on arrival keeps its hold."""
        return self._out_of_reach(s, cls, prompt_tokens, waited_s) and not self._out_of_reach(
            s, cls, prompt_tokens, 0.0
        )

    def _failures(
        self, s: LoadSnapshot, pred: Prediction, prompt_tokens: int, ttft_budget_s: float
    ) -> list[tuple[str, str]]:
        """The admission conditions ``pred`` fails, as ``(Reject.kind, text)`` (empty:
        admit)."""
        # What an idle replica would achieve: an SLO tighter than that is out of reach
        # for this request anywhere, and must not make an idle replica refuse it.
        idle_ttft, _ = self._ttft(s, prompt_tokens, 0)
        idle_tpot = self._tpot(s, prompt_tokens, 0)
        ttft_limit = self.slo_margin * ttft_budget_s
        tpot_limit = self.slo_margin * pred.tpot_slo_s
        failed = []
        if pred.ttft_s > max(ttft_limit, idle_ttft):
            failed.append(
                (
                    "ttft",
                    f"predicted TTFT {pred.ttft_s:.2f} s > {ttft_limit:.2f} s "
                    f"({self.slo_margin:g} of the budget; "
                    f"{pred.tokens_ahead} tokens ahead)"
                    if ttft_budget_s > 0
                    else f"its TTFT SLO passed while it was held (predicted TTFT "
                    f"{pred.ttft_s:.2f} s; {pred.tokens_ahead} tokens ahead)",
                )
            )
        if pred.tpot_s > max(tpot_limit, idle_tpot):
            failed.append(
                (
                    "tpot",
                    f"predicted TPOT {pred.tpot_s:.3f} s > {tpot_limit:.3f} s "
                    f"({self.slo_margin:g} of the SLO)",
                )
            )
        if not pred.seats_free:
            failed.append(
                (
                    "seats",
                    f"no seat ({pred.requests_ahead} queued ahead, max_num_seqs {s.max_num_seqs})",
                )
            )
        if not pred.kv_fits:
            failed.append(("kv_cache", f"KV cache full ({s.num_kv_blocks_free} blocks free)"))
        return failed

    def _retry_after(
        self, s: LoadSnapshot, cls: TrafficClass, load: _Load, prompt_tokens: int
    ) -> float:
        """Whole seconds (>= 1) until the queue ahead drains enough to admit a fresh one.

        Finds the largest backlog ``x <= tokens_ahead`` at which the TTFT and TPOT
        conditions hold for a request that has not waited (binary search: they only get
        harder as ``x`` grows), and predicts the time to prefill the excess in full-budget
        steps at the current decode load. Seats and KV blocks free only as requests
        finish, which the model cannot predict, so a shortage of those alone gets the
        1 s floor.
        """

        def meets(x: int) -> bool:
            pred = self._predict_at(s, cls, load, x, prompt_tokens)
            pred = dataclasses.replace(pred, seats_free=True, kv_fits=True)
            return not self._failures(s, pred, prompt_tokens, cls.ttft_slo_s)

        ahead = load.tokens_ahead
        if meets(ahead):
            excess = 0
        elif not meets(0):
            excess = ahead  # even an empty queue ahead is not enough: drain it all
        else:
            lo, hi = 0, ahead  # meets(lo) and not meets(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if meets(mid):
                    lo = mid
                else:
                    hi = mid
            excess = ahead - lo
        # The excess drains from the front of a longer queue, so in full steps.
        d = s.total_running
        per_step = max(1, s.max_num_batched_tokens - d)
        drain_s = math.ceil(excess / per_step) * s.step_time(per_step, d)
        return float(max(1, math.ceil(drain_s - 1e-9)))
