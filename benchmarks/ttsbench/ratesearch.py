"""The highest open-loop arrival rate every listener is served well at (pure: the measuring is passed in).

Procedure (each step is one open-loop run of a fixed duration or request count at one rate, ``run_open_loop``):

1. Measure ``start`` (clamped into [``low``, ``high``]).
2. While every rate so far met the bound, multiply the highest by ``growth`` (at most ``high``); while every rate
   failed, divide the lowest by ``growth`` (at least ``low``). This brackets the knee: a rate that met the bound
   below a rate that failed.
3. Bisect the bracket (arithmetic midpoint) until its width is within ``precision`` of its lower end.

It stops after ``max_steps`` measured rates, when ``high`` met the bound, or when ``low`` failed. The sustained
rate is the highest rate that met the bound below every rate that failed: a noisy pass above a failure is not
believed. Load is not carried over: each step drains its requests before the next starts.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from ttsbench.report import RateSummary, rate_table

#: What a listener needs (docs/PERFORMANCE.md): the first audio within 500 ms at p95, and no stall afterwards.
DEFAULT_FIRST_CHUNK_P95_S = 0.5


class SearchSettingsError(ValueError):
    """Rate-search settings that cannot work, with a message meant for the user."""


@dataclass(frozen=True)
class ListenerBound:
    """The bound a rate must meet: first chunk p95 within ``first_chunk_p95`` seconds, no stalled stream, no error."""

    first_chunk_p95: float = DEFAULT_FIRST_CHUNK_P95_S

    def misses(self, summary: RateSummary) -> list[str]:
        """Why ``summary`` misses the bound (empty when it meets it)."""
        reasons = []
        if summary.errors:
            reasons.append(f"{summary.errors} error(s)")
        if summary.stalls is not None and summary.stalls.stalled:
            where = summary.stalls.describe_pieces()
            reasons.append(f"{summary.stalls.stalled} stalled stream(s)" + (f" ({where})" if where else ""))
        if summary.first_chunk is None:
            reasons.append("no first chunk measured")
        elif summary.first_chunk.p95 > self.first_chunk_p95:
            p95, most = 1000 * summary.first_chunk.p95, 1000 * self.first_chunk_p95
            reasons.append(f"first chunk p95 {p95:.0f} ms > {most:.0f} ms")
        return reasons

    def met(self, summary: RateSummary) -> bool:
        return not self.misses(summary)

    def describe(self) -> str:
        return f"first chunk p95 <= {1000 * self.first_chunk_p95:.0f} ms, no stall, no error"


@dataclass(frozen=True)
class SearchSettings:
    """Where the search starts, the rates it may try (requests per second) and how long it may take."""

    start: float
    low: float
    high: float
    growth: float = 2.0
    max_steps: int = 8
    #: Bisection stops once (lowest failed - highest met) <= precision x highest met.
    precision: float = 0.1

    def __post_init__(self) -> None:
        if not (0 < self.low <= self.high and math.isfinite(self.high)):
            raise SearchSettingsError(f"rate bounds must be 0 < low <= high, got {self.low}, {self.high}")
        if not self.start > 0:
            raise SearchSettingsError(f"the start rate must be > 0, got {self.start}")
        if not self.growth > 1:
            raise SearchSettingsError(f"the growth factor must be > 1, got {self.growth}")
        if self.max_steps < 1:
            raise SearchSettingsError(f"the search needs at least one step, got {self.max_steps}")
        if not self.precision > 0:
            raise SearchSettingsError(f"the precision must be > 0, got {self.precision}")


@dataclass(frozen=True)
class RateSearch:
    """The measured steps in order, whether each met the bound, and what they say."""

    settings: SearchSettings
    bound: ListenerBound
    steps: tuple[RateSummary, ...]
    verdicts: tuple[bool, ...]

    @property
    def failed_above(self) -> float | None:
        """The lowest rate that missed the bound (the bracket's upper end); None when none did."""
        return min((s.rate for s, ok in zip(self.steps, self.verdicts) if not ok), default=None)

    @property
    def sustained(self) -> float | None:
        """The highest rate that met the bound below every rate that missed it; None when none did."""
        cap = self.failed_above
        return max((s.rate for s, ok in zip(self.steps, self.verdicts) if ok and (cap is None or s.rate < cap)),
                   default=None)  # fmt: skip

    def to_dict(self) -> dict[str, object]:
        return {
            "settings": asdict(self.settings),
            "bound": {"first_chunk_p95_max_s": self.bound.first_chunk_p95, "stalled_streams": 0, "errors": 0},
            "steps": [{"rate": s.rate, "met": ok, "misses": self.bound.misses(s)}
                      for s, ok in zip(self.steps, self.verdicts)],  # fmt: skip
            "sustained_rate": self.sustained,
            "failed_above": self.failed_above,
        }

    def table(self) -> str:
        return rate_table(self.steps, self.verdicts)

    def conclusion(self) -> str:
        """One line: the sustained rate and how well the search pinned it down."""
        sustained, failed = self.sustained, self.failed_above
        if sustained is None:
            lowest = min((s.rate for s in self.steps), default=self.settings.low)
            return f"no rate met the bound ({self.bound.describe()}); the lowest tried was {lowest:g} req/s"
        if failed is None:
            above = f" (the highest rate allowed: {self.settings.high:g})" if sustained >= self.settings.high else ""
        else:
            above = f"; {failed:g} req/s did not"
        return f"sustained open-loop rate ({self.bound.describe()}): {sustained:g} req/s{above}"


def next_rate(settings: SearchSettings, met: list[float], missed: list[float]) -> float | None:
    """The rate to measure next given the rates that met and missed the bound so far; None when done."""
    failed = min(missed, default=None)
    passed = max((r for r in met if failed is None or r < failed), default=None)
    if passed is None and failed is None:
        return min(max(settings.start, settings.low), settings.high)
    if failed is None:  # every rate met the bound: go up
        return None if passed >= settings.high else min(passed * settings.growth, settings.high)  # type: ignore[operator]
    if passed is None:  # every rate missed it: go down
        return None if failed <= settings.low else max(failed / settings.growth, settings.low)
    if failed - passed <= settings.precision * passed:
        return None
    return (passed + failed) / 2


async def search_rate(
    measure: Callable[[float], Awaitable[RateSummary]],
    settings: SearchSettings,
    bound: ListenerBound = ListenerBound(),
    on_step: Callable[[RateSummary, bool], None] | None = None,
) -> RateSearch:
    """Measure rates as the module's procedure says; ``measure(rate)`` runs one step, ``on_step`` hears each."""
    steps: list[RateSummary] = []
    verdicts: list[bool] = []
    met: list[float] = []
    missed: list[float] = []
    while len(steps) < settings.max_steps and (rate := next_rate(settings, met, missed)) is not None:
        summary = await measure(rate)
        ok = bound.met(summary)
        (met if ok else missed).append(rate)
        steps.append(summary)
        verdicts.append(ok)
        if on_step is not None:
            on_step(summary, ok)
    return RateSearch(settings, bound, tuple(steps), tuple(verdicts))
