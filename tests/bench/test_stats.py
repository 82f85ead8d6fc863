import numpy as np
import pytest

from ttsbench.stats import PERCENTILES, percentile, summarize


@pytest.mark.parametrize("size", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy_linear(size):
    values = np.random.default_rng(size).lognormal(mean=-1.0, sigma=0.7, size=size).tolist()
    for q in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_percentile_on_known_data():
    values = [10.0, 1.0, 4.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)  # between 4 and 10, 60% of the way
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_rejects_bad_q(q):
    with pytest.raises(ValueError):
        percentile([1.0], q)


def test_percentile_rejects_empty():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_matches_numpy():
    values = np.random.default_rng(7).uniform(0.05, 2.0, size=257).tolist()
    summary = summarize(values)
    assert summary is not None
    assert summary.count == 257
    assert summary.avg == pytest.approx(float(np.mean(values)))
    for q in PERCENTILES:
        assert getattr(summary, f"p{q}") == pytest.approx(float(np.percentile(values, q)))


def test_summarize_empty_is_none():
    assert summarize([]) is None
