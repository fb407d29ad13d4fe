"""Step-time model: ``seconds = a + b * prefill_tokens + c * decode_seqs``, fitted online.

A step is the budgeted mixed step of Sarathi-Serve (Agrawal et al., OSDI 2024, section 4):
every running request decodes one token and prefill chunks fill the rest of the token
budget. The replica fits this model to its measured steps; the TPOT guard and admission
predict with it. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from itertools import combinations

DEFAULT_STEP_COEFFICIENTS = (0.05, 0.002, 0.002)
"""Prior (a s, b s/prefill token, c s/decode sequence): SmolLM2-135M on a slow CPU."""

_FREE_SETS = [free for k in (1, 2, 3) for free in combinations(range(3), k)]

LOCAL_RATIO_STEPS = 8
"""Steps over which :meth:`StepTimeModel.local_ratio` takes its median."""

TAIL_RATIO_QUANTILE = 0.99
"""Quantile of measured / predicted step seconds, over the fit window, that
:meth:`StepTimeModel.worst_ratio` allows for (the step logs of
``python -m bench.scheduling --step-log FILE`` show the spread on a given host)."""


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

    Before ``min_samples`` observations the prior is used as is. Until the window is full
    the fit is not :attr:`warm`: it rests on fewer steps than it will, and a new process's
    first steps, which pay one-off costs (kernels built, caches filled on first use), weigh
    more on it.

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
            raise ValueError(
                f"window={window}, min_samples={min_samples}, "
                f"prior_weight={prior_weight}: need window >= 3, "
                "min_samples >= 1, prior_weight > 0"
            )
        self.prior = tuple(float(p) for p in prior)
        self.min_samples = min_samples
        self.prior_weight = float(prior_weight)
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._coef: tuple[float, float, float] | None = self.prior  # None: refit needed
        self._sums = [0.0] * 8
        """Sums over the window, for the normal equations (:meth:`_add`)."""
        self._since_resum = 0
        self._ratios: deque[float] = deque(maxlen=window)
        self._ranked: list[float] = []
        """``_ratios`` in ascending order (for :meth:`worst_ratio`'s quantile)."""
        """Measured / predicted seconds of the window's steps, each predicted before it
        was observed; the last ``LOCAL_RATIO_STEPS`` are the recent ones."""

    @property
    def num_samples(self) -> int:
        """Observations in the window."""
        return len(self._obs)

    @property
    def warm(self) -> bool:
        """Whether the fit's window is full: it rests on as many steps as it ever will."""
        return len(self._obs) == self._obs.maxlen

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """Record one executed step: its prefill tokens, decode sequences and wall time.

        Raises:
            ValueError: a negative or non-finite value.
        """
        if not (
            prefill_tokens >= 0 and decode_seqs >= 0 and math.isfinite(seconds) and seconds >= 0
        ):
            raise ValueError(
                f"observe({prefill_tokens!r}, {decode_seqs!r}, {seconds!r}): "
                "counts and seconds must be finite and >= 0"
            )
        if len(self._obs) >= self.min_samples:
            predicted = self.predict(prefill_tokens, decode_seqs)
            if predicted > 0:
                if len(self._ratios) == self._ratios.maxlen:
                    del self._ranked[bisect.bisect_left(self._ranked, self._ratios[0])]
                self._ratios.append(seconds / predicted)
                bisect.insort(self._ranked, seconds / predicted)
        if len(self._obs) == self._obs.maxlen:
            self._add(*self._obs[0], sign=-1.0)
        obs = (float(prefill_tokens), float(decode_seqs), float(seconds))
        self._obs.append(obs)
        self._add(*obs)
        self._since_resum += 1
        if self._since_resum >= len(self._obs):
            # Adding and removing floats leaves rounding behind: start the sums afresh
            # once per window (amortised O(1) per step).
            self._sums = [0.0] * 8
            for o in self._obs:
                self._add(*o)
            self._since_resum = 0
        self._coef = None

    def _add(self, p: float, d: float, y: float, sign: float = 1.0) -> None:
        """Update the window's sums (of p, d, pp, pd, dd, y, py, dy) by one step."""
        s = self._sums
        s[0] += sign * p
        s[1] += sign * d
        s[2] += sign * p * p
        s[3] += sign * p * d
        s[4] += sign * d * d
        s[5] += sign * y
        s[6] += sign * p * y
        s[7] += sign * d * y

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
        steps need not show, as on a shared CPU), clamped to [0.5, 3]; 1.0 before any."""
        if not self._ratios:
            return 1.0
        ranked = self._ranked
        tail = ranked[int(TAIL_RATIO_QUANTILE * (len(ranked) - 1))]
        return min(3.0, max(0.5, max(self._recent_ratios()), tail))

    def _recent_ratios(self) -> list[float]:
        return list(itertools.islice(reversed(self._ratios), LOCAL_RATIO_STEPS))

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
        sp, sd, spp, spd, sdd, sy, spy, sdy = self._sums
        xtx = [[n, sp, sd], [sp, spp, spd], [sd, spd, sdd]]
        xty = [sy, spy, sdy]
        # Ridge weight per coefficient: prior_weight observations' worth of the feature's
        # variance (the information the data carry about a slope), at least 1 so that a
        # constant feature, which the data cannot separate from ``a``, stays at its prior.
        lam = [self.prior_weight * max(xtx[i][i] / n - (xtx[0][i] / n) ** 2, 1.0) for i in range(3)]
        h = [[xtx[i][j] + (lam[i] if i == j else 0.0) for j in range(3)] for i in range(3)]
        g = [xty[i] + lam[i] * self.prior[i] for i in range(3)]

        # H is positive definite, so when the unconstrained optimum is feasible it is the
        # constrained one (the usual case; the enumeration below finds the same point).
        sol = _solve(h, g)
        if sol is not None and min(sol) >= 0:
            return (sol[0], sol[1], sol[2])
        if sol is not None:
            # Usually one coefficient goes negative (no prefill in the window, say):
            # clamp it to 0 and check the optimality conditions before enumerating.
            free = tuple(i for i in range(3) if sol[i] > 0)
            x = _on_free_set(h, g, free)
            if x is not None and all(
                sum(h[i][j] * x[j] for j in range(3)) - g[i] >= 0 for i in range(3) if i not in free
            ):
                return x
        # Minimise 0.5 x'Hx - g'x subject to x >= 0 by enumerating the free sets: the
        # constrained optimum is the unconstrained optimum on its own free set.
        best, best_obj = (0.0, 0.0, 0.0), 0.0  # x = 0 is feasible with objective 0
        for free in _FREE_SETS:
            x = _on_free_set(h, g, free)
            if x is None:
                continue
            # At the optimum on a free set H_F x_F = g_F, so the objective is -g_F.x_F / 2.
            obj = -0.5 * sum(g[i] * x[i] for i in free)
            if obj < best_obj:
                best, best_obj = x, obj
        return best


def _on_free_set(
    h: list[list[float]], g: list[float], free: tuple[int, ...]
) -> tuple[float, float, float] | None:
    """The minimiser of ``0.5 x'Hx - g'x`` with the coefficients outside ``free`` at 0;
    None when it is not >= 0 (or the system is singular)."""
    if not free:
        return None
    sol = _solve([[h[i][j] for j in free] for i in free], [g[i] for i in free])
    if sol is None or min(sol) < 0:
        return None
    x = [0.0, 0.0, 0.0]
    for i, v in zip(free, sol):
        x[i] = v
    return (x[0], x[1], x[2])


def predict_step(
    coefficients: tuple[float, float, float], prefill_tokens: float, decode_seqs: float
) -> float:
    """Seconds of a step under the linear model with these (a, b, c)."""
    a, b, c = coefficients
    return a + b * prefill_tokens + c * decode_seqs


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve ``m x = v`` for n <= 3 by Cramer's rule; None when ``m`` is singular."""
    n = len(v)
    if n == 1:
        return [v[0] / m[0][0]] if abs(m[0][0]) > 1e-300 else None
    if n == 2:
        (a, b), (c, d) = m
        det = a * d - b * c
        if abs(det) < 1e-300:
            return None
        return [(v[0] * d - b * v[1]) / det, (a * v[1] - c * v[0]) / det]
    (a, b, c), (d, e, f), (g, h, i) = m
    co = (e * i - f * h, f * g - d * i, d * h - e * g)  # cofactors of the first row
    det = a * co[0] + b * co[1] + c * co[2]
    if abs(det) < 1e-300:
        return None
    x, y, z = v
    return [
        (x * co[0] + b * (f * z - y * i) + c * (y * h - e * z)) / det,
        (a * (y * i - f * z) + x * co[1] + c * (d * z - y * g)) / det,
        (a * (e * z - y * h) + b * (y * g - d * z) + x * co[2]) / det,
    ]
