"""The step-time model admission and the TPOT guard predict with (:mod:`policies.step_time`)."""

from __future__ import annotations

import math
import random

import pytest

from policies import StepTimeModel


def test_step_time_model_recovers_known_coefficients_from_noisy_steps():
    true = (0.03, 0.0008, 0.004)
    for seed in range(3):
        rng = random.Random(seed)
        model = StepTimeModel()
        for _ in range(300):
            p, d = rng.choice([0, rng.randint(1, 512)]), rng.randint(0, 64)
            model.observe(p, d, true[0] + true[1] * p + true[2] * d + rng.gauss(0, 0.005))
        for got, want in zip(model.coefficients(), true):
            assert got == pytest.approx(want, rel=0.10)
        assert model.predict(256, 32) == pytest.approx(0.03 + 0.2048 + 0.128, rel=0.03)


def test_step_time_model_uses_the_prior_until_it_has_enough_samples():
    prior = (0.05, 0.002, 0.002)
    model = StepTimeModel(prior=prior, min_samples=8)
    assert model.coefficients() == prior
    for i in range(7):
        model.observe(100 * i, 4, 0.5)
    assert model.coefficients() == prior
    assert model.predict(100, 10) == pytest.approx(0.05 + 0.2 + 0.02)
    model.observe(700, 4, 0.5)
    assert model.coefficients() != prior


def test_step_time_model_keeps_unidentified_coefficients_at_the_prior_and_clamps():
    rng = random.Random(1)
    decode_only = StepTimeModel(prior=(0.05, 0.002, 0.002))
    for _ in range(50):
        d = rng.randint(1, 30)
        decode_only.observe(0, d, 0.01 + 0.003 * d)
    a, b, c = decode_only.coefficients()
    assert b == pytest.approx(0.002)  # no prefill seen: b cannot be learnt
    assert a == pytest.approx(0.01, abs=0.002) and c == pytest.approx(0.003, rel=0.05)

    falling = StepTimeModel()
    for _ in range(50):
        p = rng.randint(1, 300)
        falling.observe(p, 0, 0.2 - 0.0001 * p)  # a negative slope: clamped to 0
    a, b, _ = falling.coefficients()
    assert b == 0.0 and a > 0
    assert all(x >= 0 for x in falling.coefficients())


def test_step_time_model_window_follows_drift_and_rejects_bad_input():
    model = StepTimeModel(window=64)
    rng = random.Random(2)
    for slope in (0.001, 0.004):
        for _ in range(64):
            p = rng.randint(0, 512)
            model.observe(p, 8, 0.02 + slope * p + 0.001 * 8)
    assert model.coefficients()[1] == pytest.approx(0.004, rel=0.01)
    assert model.num_samples == 64
    for bad in ((-1, 0, 0.1), (0, -1, 0.1), (0, 0, math.nan), (0, 0, -0.1)):
        with pytest.raises(ValueError):
            model.observe(*bad)


def test_step_time_local_ratio_tracks_recent_error_of_the_fit():
    model = StepTimeModel(prior=(0.1, 0.001, 0.01), min_samples=10**9)  # stays the prior
    assert model.local_ratio() == 1.0
    model = StepTimeModel(prior=(0.1, 0.001, 0.01), min_samples=1)
    for i in range(40):  # a linear world: the fit is exact, the ratio 1
        p, d = (i * 37) % 200, (i * 11) % 30
        model.observe(p, d, 0.1 + 0.001 * p + 0.01 * d)
    assert model.local_ratio() == pytest.approx(1.0, rel=1e-3)
    for _ in range(8):  # recent steps at 100 prefill tokens run 30% slower than the fit
        model.observe(100, 5, 1.3 * (0.1 + 0.1 + 0.05))
    assert 1.15 < model.local_ratio() < 1.3
    for _ in range(30):  # a wild outlier regime is clamped
        model.observe(100, 5, 100.0)
    assert model.local_ratio() == 2.0


def _exact_steps(model, n):
    for i in range(n):
        p, d = (i * 37) % 200, (i * 11) % 30
        model.observe(p, d, 0.1 + 0.001 * p + 0.01 * d)


def test_step_time_worst_ratio_is_the_slowest_recent_step_or_the_window_p99():
    model = StepTimeModel(prior=(0.1, 0.001, 0.01), min_samples=1)
    assert model.worst_ratio() == 1.0
    _exact_steps(model, 240)
    model.observe(100, 5, 1.4 * 0.25)  # one slow step among 7 exact ones
    _exact_steps(model, 7)
    assert model.local_ratio() == pytest.approx(1.0, abs=0.05)  # the median ignores it
    assert model.worst_ratio() == pytest.approx(1.4, abs=0.05)
    model.observe(100, 5, 0.25)  # 8 steps later it has left the recent steps, and one
    assert model.worst_ratio() == pytest.approx(1.0, abs=0.05)  # in 255 is under the p99
    # Spikes in 4 of the window's 256 steps (the 1.4x one too: 5): they reach its 99th
    # percentile (the 4th largest of 256), so they count after leaving the recent steps.
    for _ in range(4):
        model.observe(100, 5, 2.0 * 0.25)
        _exact_steps(model, 10)
    assert model.local_ratio() == pytest.approx(1.0, abs=0.05)
    assert model.worst_ratio() == pytest.approx(2.0, abs=0.1)  # the fit moves a little
    model.observe(100, 5, 10 * 0.25)  # clamped
    assert model.worst_ratio() == 3.0


def test_the_step_time_fit_over_a_sliding_window_equals_a_fit_afresh():
    rng = random.Random(3)
    steps = [(rng.choice((0, 16, 200, 512)), rng.randint(0, 40)) for _ in range(1000)]
    obs = [(p, d, 0.04 + 0.0017 * p + 0.002 * d + rng.uniform(-0.005, 0.005)) for p, d in steps]
    rolling = StepTimeModel(window=256)
    for o in obs:
        rolling.observe(*o)
    fresh = StepTimeModel(window=256)
    for o in obs[-256:]:
        fresh.observe(*o)
    assert rolling.coefficients() == pytest.approx(fresh.coefficients(), rel=1e-9)
    assert rolling.coefficients() == pytest.approx((0.04, 0.0017, 0.002), rel=0.05)
