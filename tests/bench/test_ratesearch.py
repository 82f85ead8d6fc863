"""The rate search against fake services whose first chunk grows with the arrival rate: it finds the knee, within
its precision and step budget, and it never believes a rate that failed on the way."""

from __future__ import annotations

import pytest

from ttsbench.ratesearch import ListenerBound, SearchSettings, SearchSettingsError, next_rate, search_rate
from ttsbench.report import RateResult, RateSummary, RequestRecord, summarize_rate

STREAMS = 20
CHUNK_S = 0.5  # audio per chunk


def _summary(rate: float, first_chunk: float, *, stalled: int = 0, errors: int = 0) -> RateSummary:
    """A step of ``STREAMS`` streams whose first chunks spread up to ``first_chunk`` (the p95 lands just below
    it); ``stalled`` of them get their second chunk after the first has played, ``errors`` fail."""
    records = []
    for i in range(STREAMS):
        first = first_chunk * (0.5 + 0.5 * i / (STREAMS - 1))
        gap = 2 * CHUNK_S if i < stalled else CHUNK_S / 2
        if i >= STREAMS - errors:
            records.append(RequestRecord(f"r{i}", (first,), first, 0.0, error="HTTP 503: busy"))
        else:
            records.append(RequestRecord(f"r{i}", (first, first + gap), first + gap, 2 * CHUNK_S,
                                         chunk_seconds=(CHUNK_S, CHUNK_S)))  # fmt: skip
    return summarize_rate(RateResult("fake/streaming", rate, 0, STREAMS / rate, 1.0, tuple(records)))


class KneeService:
    """First chunk 50 ms at low rates, growing with the cube of the rate; ``knee`` is where the p95 reaches
    500 ms. ``stall_above`` / ``error_above``: rates from which one stream stalls / fails. Counts its steps."""

    def __init__(self, knee: float, stall_above: float = float("inf"), error_above: float = float("inf")) -> None:
        self.knee, self.stall_above, self.error_above = knee, stall_above, error_above
        self.rates: list[float] = []

    def p95_at(self, rate: float) -> float:
        return 0.05 + 0.45 * (rate / self.knee) ** 3

    async def __call__(self, rate: float) -> RateSummary:
        self.rates.append(rate)
        # the spread of _summary puts the p95 at 0.975 of the top (rank 0.95 x 19 of 0.5 .. 1): scale it to p95_at
        top = self.p95_at(rate) / 0.975
        return _summary(rate, top, stalled=int(rate >= self.stall_above), errors=int(rate >= self.error_above))


def test_the_fake_service_puts_the_p95_where_it_says():
    service = KneeService(knee=12.5)
    for rate in (1.0, 12.5, 20.0):
        summary = _summary(rate, service.p95_at(rate) / 0.975)
        assert summary.first_chunk.p95 == pytest.approx(service.p95_at(rate))
    assert service.p95_at(12.5) == pytest.approx(0.5)


async def test_it_grows_geometrically_then_bisects_to_the_knee():
    service = KneeService(knee=12.5)
    search = await search_rate(service, SearchSettings(start=1.0, low=0.25, high=64.0, max_steps=10))
    # the documented procedure: 1, 2, 4, 8 meet the bound, 16 misses it; then bisect (8, 16) until the bracket
    # is within 10 % of its lower end: 12 meets, 14 misses, 13 misses -> (12, 13)
    assert service.rates == [1.0, 2.0, 4.0, 8.0, 16.0, 12.0, 14.0, 13.0]
    assert search.verdicts == (True, True, True, True, False, True, False, False)
    assert search.sustained == 12.0 and search.failed_above == 13.0
    assert search.sustained <= service.knee < search.failed_above
    assert "sustained open-loop rate (first chunk p95 <= 500 ms, no stall, no error): 12 req/s" in search.conclusion()


@pytest.mark.parametrize("start", [0.3, 3.0, 40.0, 64.0])
@pytest.mark.parametrize("knee", [0.9, 7.3, 31.7])  # never a rate the search tries
async def test_it_finds_the_knee_from_any_start(start, knee):
    service = KneeService(knee=knee)
    settings = SearchSettings(start=start, low=0.25, high=64.0, max_steps=12, precision=0.05)
    search = await search_rate(service, settings)
    assert len(search.steps) <= settings.max_steps
    assert search.sustained is not None and search.failed_above is not None
    assert search.sustained <= knee < search.failed_above
    assert search.failed_above - search.sustained <= settings.precision * search.sustained
    for summary, met in zip(search.steps, search.verdicts, strict=True):  # every verdict is the bound's
        assert met == (summary.first_chunk.p95 <= 0.5)


async def test_stalls_and_errors_fail_a_rate_whatever_its_first_chunk():
    stalling = KneeService(knee=100.0, stall_above=5.0)
    search = await search_rate(stalling, SearchSettings(start=1.0, low=0.25, high=64.0, max_steps=12))
    assert search.sustained < 5.0 <= search.failed_above
    assert any(step["misses"] == ["1 stalled stream(s) (at chunk 2: 1)"] for step in search.to_dict()["steps"])
    failing = KneeService(knee=100.0, error_above=3.0)
    search = await search_rate(failing, SearchSettings(start=1.0, low=0.25, high=64.0, max_steps=12))
    assert search.sustained < 3.0 <= search.failed_above
    assert any(step["misses"] == ["1 error(s)"] for step in search.to_dict()["steps"])


async def test_it_stops_at_the_bounds():
    easy = KneeService(knee=1000.0)
    search = await search_rate(easy, SearchSettings(start=1.0, low=0.5, high=6.0))
    assert easy.rates == [1.0, 2.0, 4.0, 6.0]  # the last step is the highest rate allowed
    assert (search.sustained, search.failed_above) == (6.0, None)
    assert "highest rate allowed: 6" in search.conclusion()
    hard = KneeService(knee=0.1)
    search = await search_rate(hard, SearchSettings(start=2.0, low=0.5, high=6.0))
    assert hard.rates == [2.0, 1.0, 0.5]
    assert search.sustained is None and search.failed_above == 0.5
    assert search.conclusion().startswith("no rate met the bound") and "0.5 req/s" in search.conclusion()


async def test_it_measures_at_most_max_steps():
    service = KneeService(knee=12.5)
    search = await search_rate(service, SearchSettings(start=1.0, low=0.25, high=64.0, max_steps=3))
    assert service.rates == [1.0, 2.0, 4.0] and search.sustained == 4.0 and search.failed_above is None


async def test_a_pass_above_a_failure_is_not_believed():
    class Noisy(KneeService):
        async def __call__(self, rate):  # 8 misses (a bad moment), 16 and above would pass
            self.rates.append(rate)
            return _summary(rate, 0.7 if rate == 8.0 else 0.1)

    search = await search_rate(Noisy(knee=1.0), SearchSettings(start=16.0, low=1.0, high=16.0, max_steps=6))
    assert search.steps[0].rate == 16.0 and search.verdicts[0]
    assert search.sustained == 16.0  # nothing failed below it yet: the highest allowed rate met the bound
    noisy = Noisy(knee=1.0)
    search = await search_rate(noisy, SearchSettings(start=4.0, low=1.0, high=64.0, max_steps=4))
    assert noisy.rates == [4.0, 8.0, 6.0, 7.0]
    assert search.failed_above == 8.0 and search.sustained == 7.0


def test_next_rate_clamps_the_start_into_the_bounds():
    assert next_rate(SearchSettings(start=100.0, low=1.0, high=8.0), [], []) == 8.0
    assert next_rate(SearchSettings(start=0.1, low=1.0, high=8.0), [], []) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [dict(low=0.0), dict(low=5.0, high=4.0), dict(start=0.0), dict(growth=1.0), dict(max_steps=0),
     dict(precision=0.0), dict(high=float("inf"))],
)  # fmt: skip
def test_bad_search_settings_are_refused(kwargs):
    with pytest.raises(SearchSettingsError):
        SearchSettings(**{"start": 1.0, "low": 0.5, "high": 8.0, **kwargs})


def test_the_bound_says_why_a_rate_misses_it():
    bound = ListenerBound(0.5)
    assert bound.misses(_summary(1.0, 0.4)) == []
    assert bound.misses(_summary(1.0, 0.7, stalled=2, errors=1)) == [
        "1 error(s)", "2 stalled stream(s) (at chunk 2: 2)", "first chunk p95 665 ms > 500 ms"]  # fmt: skip
    every_request_failed = _summary(1.0, 0.1, errors=STREAMS)
    assert bound.misses(every_request_failed) == [f"{STREAMS} error(s)", "no first chunk measured"]
