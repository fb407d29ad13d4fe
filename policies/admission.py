"""SLO-aware admission: predict a request's latency on a replica, then admit, hold or reject.

The objective is goodput in DistServe's sense (Zhong et al., OSDI 2024): the rate of
requests that meet their TTFT and TPOT SLOs. Admitting a request that cannot meet its SLO
spends capacity that other requests needed to meet theirs, so under overload admission
holds requests briefly (``Wait``) and then sheds them (``Reject`` with a Retry-After)
rather than let every queue grow.

The latency model is ours. A step is the budgeted mixed step of Sarathi-Serve (Agrawal
et al., OSDI 2024, section 4): every running request decodes one token, and prefill chunks
fill the rest of a token budget (``max_num_batched_tokens``). Its time is modelled as
linear, ``a + b * prefill_tokens + c * decode_seqs`` seconds (:class:`StepTimeModel`,
fitted online on the replica). From a replica's :class:`LoadSnapshot`,
:class:`AdmissionController` predicts a new request's TTFT as the time to prefill the
tokens queued ahead of it plus its own prompt, and the TPOT that running requests would
see while that prefill drains.

Pure Python, no torch: the router imports it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from policies.priority import DEFAULT_CLASSES, TrafficClass

DEFAULT_STEP_COEFFICIENTS = (0.05, 0.002, 0.002)
"""Prior (a s, b s/prefill token, c s/decode sequence): SmolLM2-135M on a slow CPU."""

LOCAL_RATIO_STEPS = 8
"""Steps over which :meth:`StepTimeModel.local_ratio` takes its median."""

TAIL_RATIO_QUANTILE = 0.99
"""Quantile of measured / predicted step seconds, over the fit window, that
:meth:`StepTimeModel.worst_ratio` allows for (on the 2-core CPU in ``bench/scheduling.py``
step logs: median 1.00, p90 1.22, p99 2.08 over 1749 steps)."""


class StepTimeModel:
    """Online least-squares fit of ``seconds ≈ a + b * prefill_tokens + c * decode_seqs``.

    Fitted over a sliding window of the last ``window`` steps by the normal equations
    (3x3, solved in pure Python), with two safeguards:

    * a ridge penalty toward the prior, worth ``prior_weight`` observations per
      coefficient at the window's spread of that feature. With varied data it is
      negligible (it biases a slope by about ``prior_weight / window`` of its distance
      from the prior); a coefficient the data cannot identify (no prefill in the window,
      say, or a constant decode count confounded with ``a``) stays near its prior
      instead of becoming arbitrary;
    * non-negativity: the constrained optimum is found exactly by solving the
      (penalised) least squares on each subset of free coefficients, the others held at
      0, and keeping the best feasible one (8 subsets of 3 coefficients).

    Before ``min_samples`` observations the prior is used as is.

    The fit is global, and a step's time is not linear in its tokens (small GEMMs cost
    more per row), so in the regime the scheduler currently runs in it can be off by tens
    of percent; worse, the TPOT guard chooses the steps the fit learns from, which can
    leave a slope poorly identified. :meth:`local_ratio` measures that error where it
    matters: the median of measured / predicted seconds over the last few steps, each
    predicted before it was observed.

    Args:
        prior: (a seconds, b seconds per prefill token, c seconds per decode sequence).
        window: steps kept for the fit (recent ones, so the fit follows drift).
        min_samples: observations needed before the fit replaces the prior.
        prior_weight: strength of the ridge penalty, in observations.

    Raises:
        ValueError: a prior coefficient is negative, or a size is out of range.
    """

    def __init__(
        self,
        prior: tuple[float, float, float] = DEFAULT_STEP_COEFFICIENTS,
        window: int = 256,
        min_samples: int = 8,
        prior_weight: float = 0.1,
    ) -> None:
        if len(prior) != 3 or not all(math.isfinite(p) and p >= 0 for p in prior):
            raise ValueError(f"prior={prior!r}: must be three finite numbers >= 0")
        if window < 3 or min_samples < 1 or not prior_weight > 0:
            raise ValueError(f"window={window}, min_samples={min_samples}, "
                             f"prior_weight={prior_weight}: need window >= 3, "
                             "min_samples >= 1, prior_weight > 0")
        self.prior = tuple(float(p) for p in prior)
        self.min_samples = min_samples
        self.prior_weight = float(prior_weight)
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._coef: tuple[float, float, float] | None = self.prior  # None: refit needed
        self._ratios: deque[float] = deque(maxlen=window)
        """Measured / predicted seconds of the window's steps, each predicted before it
        was observed; the last ``LOCAL_RATIO_STEPS`` are the recent ones."""

    @property
    def num_samples(self) -> int:
        """Observations in the window."""
        return len(self._obs)

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """Record one executed step: its prefill tokens, decode sequences and wall time.

        Raises:
            ValueError: a negative or non-finite value.
        """
        if not (prefill_tokens >= 0 and decode_seqs >= 0 and math.isfinite(seconds)
                and seconds >= 0):
            raise ValueError(f"observe({prefill_tokens!r}, {decode_seqs!r}, {seconds!r}): "
                             "counts and seconds must be finite and >= 0")
        if len(self._obs) >= self.min_samples:
            predicted = self.predict(prefill_tokens, decode_seqs)
            if predicted > 0:
                self._ratios.append(seconds / predicted)
        self._obs.append((float(prefill_tokens), float(decode_seqs), float(seconds)))
        self._coef = None

    def local_ratio(self) -> float:
        """Median of measured / predicted seconds over the last ``LOCAL_RATIO_STEPS``
        steps (1.0 before any), clamped to [0.5, 2]: the fit's error where the engine runs
        now, for callers that need a step time to hold a limit."""
        if not self._ratios:
            return 1.0
        return min(2.0, max(0.5, statistics.median(self._recent_ratios())))

    def worst_ratio(self) -> float:
        """How far over its prediction a step may run, for a limit that one slow step
        would break: the larger of the largest measured / predicted seconds over the last
        ``LOCAL_RATIO_STEPS`` steps (where the engine runs now) and their
        ``TAIL_RATIO_QUANTILE`` quantile over the fit window (spikes that the last few
        steps need not show: 2x on a shared CPU), clamped to [0.5, 3]; 1.0 before any."""
        if not self._ratios:
            return 1.0
        ranked = sorted(self._ratios)
        tail = ranked[int(TAIL_RATIO_QUANTILE * (len(ranked) - 1))]
        return min(3.0, max(0.5, max(self._recent_ratios()), tail))

    def _recent_ratios(self) -> list[float]:
        return list(self._ratios)[-LOCAL_RATIO_STEPS:]

    def coefficients(self) -> tuple[float, float, float]:
        """(a s, b s/prefill token, c s/decode sequence), each >= 0."""
        if self._coef is None:
            self._coef = self._fit() if len(self._obs) >= self.min_samples else self.prior
        return self._coef

    def predict(self, prefill_tokens: float, decode_seqs: float) -> float:
        """Predicted seconds of a step with these prefill tokens and decode sequences."""
        return predict_step(self.coefficients(), prefill_tokens, decode_seqs)

    def _fit(self) -> tuple[float, float, float]:
        n = len(self._obs)
        rows = [(1.0, p, d) for p, d, _ in self._obs]
        ys = [y for _, _, y in self._obs]
        xtx = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        xty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]
        # Ridge weight per coefficient: prior_weight observations' worth of the feature's
        # variance (the information the data carry about a slope), at least 1 so that a
        # constant feature, which the data cannot separate from ``a``, stays at its prior.
        lam = [self.prior_weight * max(xtx[i][i] / n - (xtx[0][i] / n) ** 2, 1.0)
               for i in range(3)]
        h = [[xtx[i][j] + (lam[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        g = [xty[i] + lam[i] * self.prior[i] for i in range(3)]

        # Minimise 0.5 x'Hx - g'x subject to x >= 0 by enumerating the free sets: the
        # constrained optimum is the unconstrained optimum on its own free set.
        best, best_obj = (0.0, 0.0, 0.0), 0.0  # x = 0 is feasible with objective 0
        for k in (1, 2, 3):
            for free in combinations(range(3), k):
                sol = _solve([[h[i][j] for j in free] for i in free], [g[i] for i in free])
                if sol is None or min(sol) < 0:
                    continue
                x = [0.0, 0.0, 0.0]
                for i, v in zip(free, sol):
                    x[i] = v
                obj = 0.5 * sum(x[i] * h[i][j] * x[j] for i in range(3) for j in range(3))
                obj -= sum(g[i] * x[i] for i in range(3))
                if obj < best_obj:
                    best, best_obj = (x[0], x[1], x[2]), obj
        return best


def predict_step(coefficients: tuple[float, float, float], prefill_tokens: float,
                 decode_seqs: float) -> float:
    """Seconds of a step under the linear model with these (a, b, c)."""
    a, b, c = coefficients
    return a + b * prefill_tokens + c * decode_seqs


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve ``m x = v`` (n <= 3) by Gaussian elimination with partial pivoting."""
    n = len(v)
    aug = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(aug[r][col]))
        if abs(aug[piv][col]) < 1e-300:
            return None
        aug[col], aug[piv] = aug[piv], aug[col]
        for r in range(col + 1, n):
            f = aug[r][col] / aug[col][col]
            for c in range(col, n + 1):
                aug[r][c] -= f * aug[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (aug[i][n] - sum(aug[i][j] * x[j] for j in range(i + 1, n))) / aug[i][i]
    return x


@dataclass(kw_only=True)
class LoadSnapshot:
    """One replica's load, as the router sees it. Plain JSON types via :meth:`to_dict`.

    Per-class dicts map a traffic class name to a count; a missing class counts 0.
    """

    max_num_batched_tokens: int
    """The token budget of one step."""
    max_num_seqs: int
    """Running requests at most."""
    num_kv_blocks_free: int
    block_size: int = 16
    """Tokens per KV block."""
    waiting_prefill_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens not yet prefilled: all of each waiting request's (preempted ones: prompt
    and output so far) plus the remaining chunks of running requests still prefilling."""
    running_seqs: dict[str, int] = field(default_factory=dict)
    waiting_requests: dict[str, int] = field(default_factory=dict)
    """Requests queued for the replica (its waiting queue, plus any the router holds)."""
    kv_blocks_used: dict[str, int] = field(default_factory=dict)
    """KV blocks held by each class's running requests (optional: lets admission count
    blocks that the priority policy can reclaim from less urgent classes)."""
    kv_usage: float = 0.0
    """Fraction of the KV cache in use, 0..1."""
    step_coefficients: tuple[float, float, float] = DEFAULT_STEP_COEFFICIENTS
    """The replica's :meth:`StepTimeModel.coefficients`."""
    tpot_slo_guard: bool = False
    """The replica sheds less urgent decodes to hold the tightest TPOT SLO running."""
    tpot_slo_guard_target: float = 1.0
    """The guard holds the predicted step time at this fraction of that SLO."""
    recent_step_s: float = 0.0
    """Mean wall time of the replica's last few steps, seconds; 0 when it is idle."""
    timestamp: float = 0.0
    """When the snapshot was taken, seconds since the epoch (``time.time()``: it crosses
    processes, so not a monotonic clock)."""

    def step_time(self, prefill_tokens: float, decode_seqs: float) -> float:
        """Predicted seconds of one step on this replica."""
        return predict_step(self.step_coefficients, prefill_tokens, decode_seqs)

    @property
    def total_running(self) -> int:
        return sum(self.running_seqs.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (lists for tuples, fresh dicts)."""
        d = dataclasses.asdict(self)
        d["step_coefficients"] = list(self.step_coefficients)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadSnapshot:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (a newer replica's extras).

        Raises:
            TypeError: a required key is missing.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        for k in ("waiting_prefill_tokens", "running_seqs", "waiting_requests",
                  "kv_blocks_used"):
            if k in kwargs:
                kwargs[k] = {str(name): int(n) for name, n in kwargs[k].items()}
        if "step_coefficients" in kwargs:
            a, b, c = kwargs["step_coefficients"]
            kwargs["step_coefficients"] = (float(a), float(b), float(c))
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class Admit:
    """Send the request to the replica now."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the request; decide again within ``max_wait_s`` seconds (or on new load)."""

    max_wait_s: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request; the client may retry after ``retry_after_s`` (whole seconds)."""

    retry_after_s: float
    reason: str


Decision = Admit | Wait | Reject


@dataclass(frozen=True, slots=True)
class Prediction:
    """What :meth:`AdmissionController.predict` expects for a request on a replica."""

    ttft_s: float
    """Seconds from admission to the first token (time already waited not included)."""
    tpot_s: float
    """Mean seconds per output token that running requests would see."""
    tpot_slo_s: float
    """The TPOT SLO the prediction must meet: the tightest among the classes running and
    the new request's; under a replica's TPOT guard, the new request's own."""
    tokens_ahead: int
    """Queued prefill tokens that the request waits for."""
    requests_ahead: int
    """Queued requests of classes that go before it."""
    steps: int
    """Steps until its prompt is prefilled."""
    seats_free: bool
    """``max_num_seqs`` leaves room for it after the requests that go before it."""
    kv_fits: bool
    """Free (or reclaimable) KV blocks hold the prefill ahead and its prompt."""


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


class AdmissionController:
    """Admit, hold or reject a request for a replica so that SLOs are met (see module doc).

    The model of one replica under a request of class ``k`` with priority ``p``:

    * Ahead of it: the queued prefill tokens and requests of classes whose
      ``default_priority <= p`` (under the priority policy less urgent queued work does not
      delay it; with ``priority_scheduling=False``, FCFS, all queued work is ahead).
      Classes unknown to the controller count as ahead (conservative).
    * Each step decodes every running request (``d``) and prefills up to
      ``m = min(budget - d, cap)`` tokens (at least 1), where ``cap`` is what the
      replica's TPOT guard allows (``LoadSnapshot.tpot_slo_guard``, priority scheduling:
      the prefill that keeps ``a + c * d + b * m`` within the tightest running TPOT SLO
      times ``tpot_slo_guard_target``), else unbounded. Prefilling ``x`` tokens ahead
      plus the prompt ``P`` takes ``n = ceil((x + P) / m)`` steps, and
      ``TTFT = r + n * (a + c * d) + b * min(n * m, max(x + P, X))``: ``r`` is the step
      in flight (``LoadSnapshot.recent_step_s``; a request joins the next step), and
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
      tightest SLO running binds. With the guard and priority scheduling, ``d`` counts
      only running requests served before this one and the SLO is its own: the guard
      sheds less urgent decodes for it, and its decodes for more urgent ones.
    * Seats: the running requests of classes that go before it plus the requests queued
      ahead plus this one must fit ``max_num_seqs`` (less urgent running requests can be
      preempted by the priority policy); else its TTFT hangs on decodes finishing, which
      the model cannot predict.
    * KV: ``ceil((x + P) / block_size) + 1`` blocks (one block of decode headroom) must be
      free, counting blocks of less urgent classes as free under priority scheduling.

    The TTFT budget is the SLO minus ``waited_s`` (the SLO counts from arrival). A
    prediction must fit ``slo_margin`` times its budget or SLO: the rest absorbs
    prediction error (about 0.3 s mean absolute error on a 2 s TTFT SLO in
    ``bench/scheduling.py``). An SLO the request could not meet even on an idle replica
    (a very long prompt) is replaced by what an idle replica would achieve, so an idle
    replica always admits.

    Args:
        classes: traffic classes by name.
        priority_scheduling: whether the replicas run the priority policy.
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
        priority_scheduling: bool = True,
        tpot_horizon_steps: int = 32,
        slo_margin: float = 0.85,
    ) -> None:
        if tpot_horizon_steps < 1:
            raise ValueError(f"tpot_horizon_steps={tpot_horizon_steps!r}: must be >= 1")
        if not 0 < slo_margin <= 1:
            raise ValueError(f"slo_margin={slo_margin!r}: must be in (0, 1]")
        self.classes = dict(classes)
        self.priority_scheduling = priority_scheduling
        self.tpot_horizon_steps = tpot_horizon_steps
        self.slo_margin = slo_margin

    def _class(self, name: str) -> TrafficClass:
        try:
            return self.classes[name]
        except KeyError:
            raise ValueError(f"unknown traffic class {name!r}; known: "
                             f"{sorted(self.classes)}") from None

    def _goes_before(self, name: str, priority: int) -> bool:
        """Whether class ``name``'s work is served before a request of ``priority``."""
        if not self.priority_scheduling or name not in self.classes:
            return True
        return self.classes[name].default_priority <= priority

    # -- the model ---------------------------------------------------------------------

    def _ttft(self, s: LoadSnapshot, tokens: int, d: int, *, total: int = 0,
              cap: float = math.inf, residual_s: float = 0.0) -> tuple[float, int]:
        """(seconds, steps) to prefill ``tokens`` alongside ``d`` decodes.

        Steps take at most ``cap`` prefill tokens (the TPOT guard's) and are filled up to
        their budget from ``total`` queued tokens (less urgent work included: it shares
        the steps it does not delay). ``residual_s``: the step in flight, which a new
        request cannot join.
        """
        a, b, c = s.step_coefficients
        per_step = max(1, min(s.max_num_batched_tokens - d, cap))
        steps = max(1, math.ceil(tokens / per_step))
        executed = min(steps * per_step, max(tokens, total))
        return residual_s + steps * (a + c * d) + b * executed, steps

    def _tpot(self, s: LoadSnapshot, tokens: int, d: int, cap: float = math.inf) -> float:
        _, steps = self._ttft(s, tokens, d, cap=cap)
        return s.step_time(tokens / max(steps, self.tpot_horizon_steps), d + 1)

    def _guard_cap(self, s: LoadSnapshot, load: _Load, d: int) -> float:
        """Prefill tokens per step that the replica's TPOT guard allows (inf: no guard)."""
        if not (s.tpot_slo_guard and load.tpot_slos):
            return math.inf
        a, b, c = s.step_coefficients
        limit = min(load.tpot_slos) * s.tpot_slo_guard_target
        spare = limit - (a + c * d)
        return max(s.block_size, math.floor(spare / b)) if b > 0 else math.inf

    def _kv_fits(self, s: LoadSnapshot, tokens: int, reclaimable: int) -> bool:
        return math.ceil(tokens / s.block_size) + 1 <= s.num_kv_blocks_free + reclaimable

    def _load(self, s: LoadSnapshot, priority: int) -> _Load:
        before = {k for k in {*s.waiting_prefill_tokens, *s.waiting_requests,
                              *s.running_seqs, *s.kv_blocks_used}
                  if self._goes_before(k, priority)}
        return _Load(
            tokens_ahead=sum(n for k, n in s.waiting_prefill_tokens.items() if k in before),
            requests_ahead=sum(n for k, n in s.waiting_requests.items() if k in before),
            running_before=sum(n for k, n in s.running_seqs.items() if k in before),
            tokens_total=sum(s.waiting_prefill_tokens.values()),
            reclaimable_blocks=sum(n for k, n in s.kv_blocks_used.items() if k not in before),
            tpot_slos=tuple(self.classes[k].tpot_slo_s for k, n in s.running_seqs.items()
                            if n > 0 and k in self.classes),
        )

    def _predict_at(self, s: LoadSnapshot, cls: TrafficClass, load: _Load, tokens_ahead: int,
                    prompt_tokens: int) -> Prediction:
        """The prediction with ``tokens_ahead`` queued ahead instead of the snapshot's."""
        d = s.total_running
        tokens = tokens_ahead + prompt_tokens
        cap = self._guard_cap(s, load, d)
        total = load.tokens_total - load.tokens_ahead + tokens
        ttft, steps = self._ttft(s, tokens, d, total=total, cap=cap,
                                 residual_s=s.recent_step_s)
        if s.tpot_slo_guard and self.priority_scheduling:
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

    def predict(self, snapshot: LoadSnapshot, traffic_class: str, prompt_tokens: int,
                priority: int | None = None) -> Prediction:
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

    def decide(self, snapshot: LoadSnapshot, traffic_class: str, prompt_tokens: int,
               max_tokens: int, priority: int, waited_s: float) -> Decision:
        """Admit, Wait or Reject a request of ``traffic_class`` for ``snapshot``'s replica.

        Admit when the predicted TTFT fits ``slo_margin`` of the class's TTFT SLO less
        ``waited_s``, the predicted TPOT fits ``slo_margin`` of the tightest TPOT SLO
        involved, and seats and KV suffice.
        Otherwise, at the class's ``hard_queue_cap``: Reject. Else, before
        ``max_queue_wait_s``: Wait for the rest of it. Else Reject a rejectable class,
        with a Retry-After of the predicted time until the queue ahead has drained enough
        to admit a fresh request (at least 1 s, whole seconds; assumes nothing more urgent
        arrives meanwhile); a non-rejectable class Waits again, for at most that long.

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
            raise ValueError(f"prompt_tokens={prompt_tokens!r}, max_tokens={max_tokens!r}, "
                             f"waited_s={waited_s!r}: must be >= 0")
        s = snapshot
        load = self._load(s, priority)
        pred = self._predict_at(s, cls, load, load.tokens_ahead, prompt_tokens)
        failed = self._failures(s, pred, prompt_tokens, cls.ttft_slo_s - waited_s)
        if not failed:
            return Admit()
        reason = f"{cls.name}: " + "; ".join(failed)
        cap = cls.hard_queue_cap
        if cap is not None and s.waiting_requests.get(cls.name, 0) >= cap:
            return Reject(self._retry_after(s, cls, load, prompt_tokens),
                          f"{cls.name}: queue at its cap of {cap} requests")
        if waited_s < cls.max_queue_wait_s:
            return Wait(cls.max_queue_wait_s - waited_s, reason)
        retry = self._retry_after(s, cls, load, prompt_tokens)
        if cls.rejectable:
            return Reject(retry, reason)
        return Wait(min(cls.max_queue_wait_s, retry), reason)

    def _failures(self, s: LoadSnapshot, pred: Prediction, prompt_tokens: int,
                  ttft_budget_s: float) -> list[str]:
        """The admission conditions ``pred`` fails (empty: admit)."""
        # What an idle replica would achieve: an SLO tighter than that is out of reach
        # for this request anywhere, and must not make an idle replica refuse it.
        idle_ttft, _ = self._ttft(s, prompt_tokens, 0)
        idle_tpot = self._tpot(s, prompt_tokens, 0)
        ttft_limit = self.slo_margin * ttft_budget_s
        tpot_limit = self.slo_margin * pred.tpot_slo_s
        failed = []
        if pred.ttft_s > max(ttft_limit, idle_ttft):
            failed.append(f"predicted TTFT {pred.ttft_s:.2f} s > {ttft_limit:.2f} s "
                          f"({self.slo_margin:g} of the budget; {pred.tokens_ahead} tokens "
                          "ahead)")
        if pred.tpot_s > max(tpot_limit, idle_tpot):
            failed.append(f"predicted TPOT {pred.tpot_s:.3f} s > {tpot_limit:.3f} s "
                          f"({self.slo_margin:g} of the SLO)")
        if not pred.seats_free:
            failed.append(f"no seat ({pred.requests_ahead} queued ahead, "
                          f"max_num_seqs {s.max_num_seqs})")
        if not pred.kv_fits:
            failed.append(f"KV cache full ({s.num_kv_blocks_free} blocks free)")
        return failed

    def _retry_after(self, s: LoadSnapshot, cls: TrafficClass, load: _Load,
                     prompt_tokens: int) -> float:
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


class PredictionLog:
    """Predicted against measured TTFT, to check the admission model on real traffic.

    Args:
        maxlen: pairs kept (the most recent); None: all.
    """

    def __init__(self, maxlen: int | None = 10_000) -> None:
        self._pairs: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def record(self, predicted_ttft_s: float, actual_ttft_s: float) -> None:
        self._pairs.append((float(predicted_ttft_s), float(actual_ttft_s)))

    def __len__(self) -> int:
        return len(self._pairs)

    def mean_absolute_error(self) -> float:
        """Mean of ``|predicted - actual|`` in seconds; NaN when empty."""
        if not self._pairs:
            return math.nan
        return statistics.fmean(abs(p - a) for p, a in self._pairs)

    def median_relative_error(self) -> float:
        """Median of ``|predicted - actual| / actual`` over pairs with actual > 0; NaN if none."""
        rel = [abs(p - a) / a for p, a in self._pairs if a > 0]
        return statistics.median(rel) if rel else math.nan

    def summary(self) -> dict[str, float]:
        return {"count": float(len(self)), "mae_s": self.mean_absolute_error(),
                "median_rel_error": self.median_relative_error()}
