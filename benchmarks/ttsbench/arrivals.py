"""Open-loop load: when requests arrive and which request each one is (pure, seeded).

Arrivals form a Poisson process: the gaps between them are independent and exponentially distributed with mean
1 / rate, so requests come in bursts and lulls the way independent listeners do, not on a fixed beat. Everything
is drawn from ``seed``, so a run can be repeated exactly; the arrival times and the request picks come from two
separate streams of that seed, so changing the request mix does not move the arrivals. With one seed, the
arrivals at two rates are the same pattern scaled in time (the same unit-rate gaps divided by the rate): the steps
of a rate search differ in their rate only, not in their luck.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")

#: Sub-streams of one seed (numpy SeedSequence entropy): arrival gaps, request picks.
_ARRIVALS, _PICKS = 0, 1
#: Gaps are drawn in blocks of this many while filling a duration (any size gives the same times).
_BLOCK = 256


def _rng(seed: int, stream: int) -> np.random.Generator:
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.default_rng([seed, stream])


def poisson_arrivals(rate: float, seed: int, *, count: int | None = None, duration: float | None = None) -> list[float]:
    """Arrival times (seconds from the start, increasing) of a Poisson process of ``rate`` requests per second:
    the first ``count`` arrivals, or every arrival before ``duration`` seconds (give exactly one)."""
    if not rate > 0 or not np.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    if (count is None) == (duration is None):
        raise ValueError("give exactly one of count and duration")
    rng = _rng(seed, _ARRIVALS)
    if count is not None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return np.cumsum(rng.standard_exponential(count) / rate).tolist()
    if not duration >= 0:  # type: ignore[operator]
        raise ValueError(f"duration must be >= 0, got {duration}")
    times: list[float] = []
    now = 0.0
    while True:  # unit-rate gaps drawn block by block are the same stream as one long draw
        for gap in rng.standard_exponential(_BLOCK) / rate:
            now += float(gap)
            if now >= duration:  # type: ignore[operator]
                return times
            times.append(now)


def draw_requests(items: Sequence[T], count: int, seed: int) -> list[T]:
    """``count`` items drawn uniformly at random, with replacement, from the mix ``items``."""
    if not items:
        raise ValueError("no requests to draw from")
    return [items[i] for i in _rng(seed, _PICKS).integers(0, len(items), size=count)]
