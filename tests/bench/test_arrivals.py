"""Poisson arrivals and the request mix of the open loop: seeded, the right mean rate, and really Poisson (checks
that a fixed-interval or merely jittered generator fails)."""

import math

import numpy as np
import pytest

from ttsbench.arrivals import draw_requests, poisson_arrivals


def _gaps(times):
    return np.diff([0.0, *times])


def test_the_same_seed_gives_the_same_arrivals_and_another_seed_others():
    assert poisson_arrivals(3.0, 7, count=50) == poisson_arrivals(3.0, 7, count=50)
    assert poisson_arrivals(3.0, 7, duration=20.0) == poisson_arrivals(3.0, 7, duration=20.0)
    assert poisson_arrivals(3.0, 8, count=50) != poisson_arrivals(3.0, 7, count=50)


def test_arrivals_increase_and_a_duration_keeps_only_those_before_it():
    times = poisson_arrivals(5.0, 1, duration=100.0)
    assert times == sorted(times) and len(set(times)) == len(times)
    assert 0.0 < times[0] and times[-1] < 100.0
    # one stream of gaps: a duration is a prefix of the count sequence
    assert times == pytest.approx(poisson_arrivals(5.0, 1, count=len(times)), rel=1e-12)
    assert poisson_arrivals(5.0, 1, count=len(times) + 1)[-1] >= 100.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rate", [0.5, 8.0, 120.0])
def test_mean_rate_is_the_rate_asked_for(rate, seed):
    n = 5000  # the mean gap's standard error is 1.4 % of it: 5 % is more than 3 standard errors
    times = poisson_arrivals(rate, seed, count=n)
    assert n / times[-1] == pytest.approx(rate, rel=0.05)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gaps_are_exponential_not_fixed_or_jittered(seed):
    rate, n = 4.0, 5000
    gaps = _gaps(poisson_arrivals(rate, seed, count=n))
    # coefficient of variation: 1 for exponential gaps, 0 for a fixed interval, 0.58 for uniform jitter
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.06)
    # Kolmogorov-Smirnov distance to Exp(rate): below the 0.1 % critical value 1.95 / sqrt(n) = 0.028
    ordered = np.sort(gaps)
    cdf = 1.0 - np.exp(-rate * ordered)
    steps = np.arange(1, n + 1) / n
    distance = max(np.max(steps - cdf), np.max(cdf - (steps - 1.0 / n)))
    assert distance < 1.95 / math.sqrt(n)


def test_the_kolmogorov_smirnov_check_rejects_a_fixed_interval():
    """The check above can fail: evenly spaced arrivals at the same mean rate are far from Exp(rate)."""
    rate, n = 4.0, 5000
    ordered = np.full(n, 1.0 / rate)
    cdf = 1.0 - np.exp(-rate * ordered)
    steps = np.arange(1, n + 1) / n
    assert max(np.max(steps - cdf), np.max(cdf - (steps - 1.0 / n))) > 0.5


def test_counts_in_a_window_vary_like_a_poisson_variable():
    rate, duration, seeds = 6.0, 5.0, 300
    counts = np.array([len(poisson_arrivals(rate, seed, duration=duration)) for seed in range(seeds)])
    mean = rate * duration
    assert counts.mean() == pytest.approx(mean, rel=0.05)
    # index of dispersion: 1 for Poisson counts, 0 for a fixed interval (its sd over 300 windows is about 0.08)
    assert counts.var(ddof=1) / counts.mean() == pytest.approx(1.0, abs=0.3)


def test_one_seed_gives_the_same_pattern_at_every_rate():
    assert poisson_arrivals(2.0, 5, count=30) == pytest.approx([t / 2 for t in poisson_arrivals(1.0, 5, count=30)])


@pytest.mark.parametrize(
    ("rate", "kwargs"),
    [(0.0, {"count": 3}), (-1.0, {"count": 3}), (math.inf, {"count": 3}), (1.0, {}),
     (1.0, {"count": 3, "duration": 1.0}), (1.0, {"count": -1}), (1.0, {"duration": -1.0})],
)  # fmt: skip
def test_bad_arrival_settings_are_refused(rate, kwargs):
    with pytest.raises(ValueError):
        poisson_arrivals(rate, 0, **kwargs)


def test_requests_are_drawn_from_the_whole_mix_by_the_seed():
    mix = [f"item{i}" for i in range(20)]
    picks = draw_requests(mix, 4000, seed=3)
    assert picks == draw_requests(mix, 4000, seed=3) and picks != draw_requests(mix, 4000, seed=4)
    counts = np.array([picks.count(item) for item in mix])
    # chi-square with 19 degrees of freedom: 43.8 is its 0.1 % critical value
    expected = 4000 / len(mix)
    assert float(((counts - expected) ** 2 / expected).sum()) < 43.8
    # a shorter draw is the start of a longer one
    assert draw_requests(mix, 5, seed=3) == picks[:5]
    with pytest.raises(ValueError):
        draw_requests([], 1, seed=0)
