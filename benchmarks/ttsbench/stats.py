"""Descriptive statistics used by the reports (pure Python, no numpy)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

#: The percentiles every latency/RTF summary reports.
PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks.

    Same definition as ``numpy.percentile(values, q)`` (method "linear"), so numbers compare
    directly with the upstream client's.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class Summary:
    """Mean and the standard percentiles of one metric over the requests of one level."""

    count: int
    avg: float
    p50: float
    p90: float
    p95: float
    p99: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary | None:
    """Summary of ``values``; None when there is nothing to summarize (e.g. no second chunks)."""
    if not values:
        return None
    p50, p90, p95, p99 = (percentile(values, q) for q in PERCENTILES)
    return Summary(count=len(values), avg=math.fsum(values) / len(values), p50=p50, p90=p90, p95=p95, p99=p99)
