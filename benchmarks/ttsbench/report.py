"""Per-request records, per-level summaries, the text table and the JSON document (all pure)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ttsbench.playback import StallSummary, stream_stalls, summarize_stalls
from ttsbench.stats import Summary, summarize

#: 2: per-piece audio durations in the records, playback stalls and the measured window per level.
#: 3: open-loop rates (``rates``) and the rate search (``rate_search``).
JSON_SCHEMA_VERSION = 3


def is_streaming(mode: str) -> bool:
    """Whether a target mode (``triton/streaming``, ``gateway/streaming-sse``, ...) streams its audio."""
    return mode.rpartition("/")[2].startswith("streaming")


@dataclass(frozen=True)
class RequestRecord:
    """What one measured request did. Times are seconds, measured from the moment it was sent."""

    item_id: str
    #: Arrival time of every non-empty audio piece, in order.
    chunk_offsets: tuple[float, ...]
    #: Until the response was complete (or failed).
    total: float
    audio_seconds: float
    error: str | None = None
    #: Audio duration carried by each piece (parallel to ``chunk_offsets``; empty when unknown).
    chunk_seconds: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def first_chunk(self) -> float | None:
        return self.chunk_offsets[0] if self.chunk_offsets else None

    @property
    def second_chunk(self) -> float | None:
        """Gap between the first and the second audio piece (the upstream client's definition)."""
        return self.chunk_offsets[1] - self.chunk_offsets[0] if len(self.chunk_offsets) > 1 else None

    @property
    def rtf(self) -> float | None:
        return self.total / self.audio_seconds if self.audio_seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "item_id": self.item_id,
            "chunk_offsets": list(self.chunk_offsets),
            "total": self.total,
            "audio_seconds": self.audio_seconds,
            "chunk_seconds": list(self.chunk_seconds),
            "error": self.error,
        }


@dataclass(frozen=True)
class LevelResult:
    """All measured requests of one (mode, concurrency) level, warm-up excluded."""

    mode: str
    concurrency: int
    #: From the first measured send to the last measured completion.
    wall_seconds: float
    records: tuple[RequestRecord, ...]
    #: Wall-clock (epoch seconds) start and end of the measured part, warm-up excluded: lets a caller
    #: match samples taken outside the benchmark (GPU utilization) to this level.
    window: tuple[float, float] | None = None


@dataclass(frozen=True)
class LevelSummary:
    mode: str
    concurrency: int
    requests: int
    errors: int
    wall_seconds: float
    audio_seconds: float
    first_chunk: Summary | None
    second_chunk: Summary | None
    total: Summary | None
    rtf: Summary | None
    #: Wall time of the level / audio seconds produced by it (the upstream client's "RTF").
    aggregate_rtf: float | None
    audio_seconds_per_second: float
    #: Playback stalls over the successful streams (streaming modes only).
    stalls: StallSummary | None = None
    window: tuple[float, float] | None = None
    records: tuple[RequestRecord, ...] = field(default=(), repr=False)

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "errors": self.errors,
            "wall_seconds": self.wall_seconds,
            "audio_seconds": self.audio_seconds,
            "aggregate_rtf": self.aggregate_rtf,
            "audio_seconds_per_second": self.audio_seconds_per_second,
            "stalls": self.stalls.to_dict() if self.stalls else None,
            "window": list(self.window) if self.window else None,
        }
        for name in ("first_chunk", "second_chunk", "total", "rtf"):
            summary: Summary | None = getattr(self, name)
            out[name] = summary.to_dict() if summary else None
        if with_records:
            out["records"] = [r.to_dict() for r in self.records]
        return out


def summarize_level(result: LevelResult) -> LevelSummary:
    """Statistics over the successful requests; failures only count as errors."""
    ok = [r for r in result.records if r.ok]
    audio = math.fsum(r.audio_seconds for r in ok)

    def present(values: Iterable[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    return LevelSummary(
        mode=result.mode,
        concurrency=result.concurrency,
        requests=len(result.records),
        errors=len(result.records) - len(ok),
        wall_seconds=result.wall_seconds,
        audio_seconds=audio,
        first_chunk=summarize(present(r.first_chunk for r in ok)),
        second_chunk=summarize(present(r.second_chunk for r in ok)),
        total=summarize([r.total for r in ok]),
        rtf=summarize(present(r.rtf for r in ok)),
        aggregate_rtf=result.wall_seconds / audio if audio > 0 else None,
        audio_seconds_per_second=audio / result.wall_seconds if result.wall_seconds > 0 else 0.0,
        stalls=stream_stall_summary(result.mode, ok),
        window=result.window,
        records=result.records,
    )


def stream_stall_summary(mode: str, ok: Sequence[RequestRecord]) -> StallSummary | None:
    """Playback stalls over the successful requests ``ok`` of a streaming ``mode`` (None for other modes)."""
    if not is_streaming(mode):
        return None
    # a record whose piece durations are unknown cannot be replayed
    known = [r for r in ok if r.chunk_offsets and len(r.chunk_seconds) == len(r.chunk_offsets)]
    return summarize_stalls([stream_stalls(r.chunk_offsets, r.chunk_seconds) for r in known])


# Open loop -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RateResult:
    """All requests of one open-loop run: Poisson arrivals at ``rate`` requests per second (``ttsbench.arrivals``),
    each sent when it arrives, however many earlier ones are still running."""

    mode: str
    #: The offered arrival rate (requests per second) and the seed of the arrivals and request picks.
    rate: float
    seed: int
    #: Over how long the arrivals were offered: the duration asked for, or until the last send in count mode.
    arrival_seconds: float
    #: From the first send to the last completion.
    wall_seconds: float
    records: tuple[RequestRecord, ...]
    #: How late each request was sent against its arrival time: the load generator's own lag (near zero unless
    #: the machine running the benchmark cannot keep up, which makes the rate's numbers meaningless).
    send_lags: tuple[float, ...] = ()
    #: The most requests running at once.
    max_in_flight: int = 0
    #: Wall-clock (epoch seconds) start and end, as ``LevelResult.window``.
    window: tuple[float, float] | None = None


@dataclass(frozen=True)
class RateSummary:
    mode: str
    rate: float
    seed: int
    #: Requests sent per second of the arrival span (a finite Poisson sample is near ``rate``, not on it).
    achieved_rate: float
    requests: int
    errors: int
    wall_seconds: float
    audio_seconds: float
    audio_seconds_per_second: float
    max_in_flight: int
    first_chunk: Summary | None
    total: Summary | None
    stalls: StallSummary | None
    send_lag: Summary | None
    window: tuple[float, float] | None = None
    records: tuple[RequestRecord, ...] = field(default=(), repr=False)

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "rate": self.rate,
            "seed": self.seed,
            "achieved_rate": self.achieved_rate,
            "requests": self.requests,
            "errors": self.errors,
            "wall_seconds": self.wall_seconds,
            "audio_seconds": self.audio_seconds,
            "audio_seconds_per_second": self.audio_seconds_per_second,
            "max_in_flight": self.max_in_flight,
            "stalls": self.stalls.to_dict() if self.stalls else None,
            "window": list(self.window) if self.window else None,
        }
        for name in ("first_chunk", "total", "send_lag"):
            summary: Summary | None = getattr(self, name)
            out[name] = summary.to_dict() if summary else None
        if with_records:
            out["records"] = [r.to_dict() for r in self.records]
        return out


def summarize_rate(result: RateResult) -> RateSummary:
    """Statistics over the successful requests of one rate; failures only count as errors."""
    ok = [r for r in result.records if r.ok]
    audio = math.fsum(r.audio_seconds for r in ok)
    sent = len(result.records)
    return RateSummary(
        mode=result.mode,
        rate=result.rate,
        seed=result.seed,
        achieved_rate=sent / result.arrival_seconds if result.arrival_seconds > 0 else 0.0,
        requests=sent,
        errors=sent - len(ok),
        wall_seconds=result.wall_seconds,
        audio_seconds=audio,
        audio_seconds_per_second=audio / result.wall_seconds if result.wall_seconds > 0 else 0.0,
        max_in_flight=result.max_in_flight,
        first_chunk=summarize([r.first_chunk for r in ok if r.first_chunk is not None]),
        total=summarize([r.total for r in ok]),
        stalls=stream_stall_summary(result.mode, ok),
        send_lag=summarize(result.send_lags),
        window=result.window,
        records=result.records,
    )


# Text table ------------------------------------------------------------------------------------

_STATS = ("avg", "p50", "p90", "p95", "p99")
#: (group title, LevelSummary attribute, scale, format) of the summarized columns.
_GROUPS: tuple[tuple[str, str, float, str], ...] = (
    ("first chunk (ms)", "first_chunk", 1000.0, "{:.1f}"),
    ("second chunk gap (ms)", "second_chunk", 1000.0, "{:.1f}"),
    ("total latency (ms)", "total", 1000.0, "{:.1f}"),
    ("RTF per request", "rtf", 1.0, "{:.4f}"),
)
_MISSING = "-"
#: The first-chunk percentiles of the open-loop table (no mean: the tail is what a listener meets).
_RATE_FIRST_CHUNK = ("p50", "p90", "p95", "p99")


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    groups: Sequence[tuple[str, int]] = (),
    gap: int = 2,
) -> str:
    """Right-aligned plain-text columns under a header row.

    ``groups`` optionally adds a line above the header with titles spanning consecutive columns,
    as (title, number of columns) pairs covering the columns left to right.
    """
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    sep = " " * gap
    lines = []
    if groups:
        if sum(n for _, n in groups) != len(header):
            raise ValueError("column groups must cover every column")
        cells, col = [], 0
        for title, n in groups:
            span = sum(widths[col : col + n]) + gap * (n - 1)
            if len(title) > span:  # widen the group's last column so the title fits
                widths[col + n - 1] += len(title) - span
                span = len(title)
            cells.append(title.center(span))
            col += n
        lines.append(sep.join(cells).rstrip())
    lines.append(sep.join(cell.rjust(w) for cell, w in zip(header, widths, strict=True)))
    lines.append("-" * len(lines[-1]))
    lines.extend(sep.join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(lines)


def _summary_cells(summary: Summary | None, scale: float, fmt: str) -> list[str]:
    if summary is None:
        return [_MISSING] * len(_STATS)
    return [fmt.format(getattr(summary, s) * scale) for s in _STATS]


#: Stall columns: streams that stalled / streams, then total stall time summed over streams and its
#: p50/p90/max over streams.
_STALL_COLUMNS = ("stalled", "sum", "p50", "p90", "max")


def stall_cells(stalls: StallSummary | None) -> list[str]:
    """The stall columns of one level (``-`` where the level does not stream)."""
    if stalls is None:
        return [_MISSING] * len(_STALL_COLUMNS)
    times = (stalls.total, stalls.p50, stalls.p90, stalls.max)
    return [f"{stalls.stalled}/{stalls.streams}", *(f"{1000.0 * t:.1f}" for t in times)]


def level_table(summaries: Sequence[LevelSummary]) -> str:
    """One table for one mode: a row per concurrency level."""
    header = ["conc", "ok", "err"]
    groups: list[tuple[str, int]] = [("", 3)]
    for title, *_ in _GROUPS:
        header += list(_STATS)
        groups.append((title, len(_STATS)))
    header += list(_STALL_COLUMNS)
    groups.append(("playback stalls (ms)", len(_STALL_COLUMNS)))
    header += ["agg RTF", "audio s/s"]
    groups.append(("throughput", 2))
    rows = []
    for s in summaries:
        row = [str(s.concurrency), str(s.requests - s.errors), str(s.errors)]
        for _, attr, scale, fmt in _GROUPS:
            row += _summary_cells(getattr(s, attr), scale, fmt)
        row += stall_cells(s.stalls)
        row += [_MISSING if s.aggregate_rtf is None else f"{s.aggregate_rtf:.4f}", f"{s.audio_seconds_per_second:.2f}"]
        rows.append(row)
    return format_table(header, rows, groups)


def rate_table(summaries: Sequence[RateSummary], verdicts: Sequence[bool] | None = None) -> str:
    """One open-loop table: a row per rate, in the order given; ``verdicts`` adds whether each met a bound."""
    if verdicts is not None and len(verdicts) != len(summaries):
        raise ValueError(f"{len(verdicts)} verdicts for {len(summaries)} rates")
    header = ["rate", "achieved", "ok", "err", "in flight"]
    groups: list[tuple[str, int]] = [("arrivals (req/s)", 2), ("", 3)]
    header += list(_RATE_FIRST_CHUNK)
    groups.append(("first chunk (ms)", len(_RATE_FIRST_CHUNK)))
    header += ["stalled", "share"]
    groups.append(("stalled streams", 2))
    header += ["audio s/s", "send lag p99 (ms)"]
    groups.append(("", 2))
    if verdicts is not None:
        header.append("meets")
        groups.append(("", 1))
    rows = []
    for i, s in enumerate(summaries):
        row = [f"{s.rate:g}", f"{s.achieved_rate:.2f}", str(s.requests - s.errors), str(s.errors), str(s.max_in_flight)]
        row += [_MISSING if s.first_chunk is None else f"{1000.0 * getattr(s.first_chunk, q):.1f}"
                for q in _RATE_FIRST_CHUNK]  # fmt: skip
        if s.stalls is None:
            row += [_MISSING, _MISSING]
        else:
            row += [f"{s.stalls.stalled}/{s.stalls.streams}", f"{100.0 * s.stalls.stalled_share:.0f}%"]
        lag = _MISSING if s.send_lag is None else f"{1000.0 * s.send_lag.p99:.1f}"
        row += [f"{s.audio_seconds_per_second:.2f}", lag]
        if verdicts is not None:
            row.append("yes" if verdicts[i] else "no")
        rows.append(row)
    return format_table(header, rows, groups)


def render_report(summaries: Sequence[LevelSummary]) -> str:
    """A titled table per mode, modes in first-seen order."""
    modes = list(dict.fromkeys(s.mode for s in summaries))
    blocks = []
    for mode in modes:
        mine = [s for s in summaries if s.mode == mode]
        blocks.append(f"== {mode} ==\n{level_table(mine)}")
    return "\n\n".join(blocks)


def report_document(
    summaries: Sequence[LevelSummary],
    run: dict[str, Any],
    with_records: bool = True,
    rates: Sequence[RateSummary] = (),
    rate_search: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document ``--json`` writes: the run's settings, one entry per closed-loop level, one per open-loop
    rate and, after a rate search, its outcome (``RateSearch.to_dict``; its steps are the ``rates``)."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "run": run,
        "levels": [s.to_dict(with_records=with_records) for s in summaries],
        "rates": [s.to_dict(with_records=with_records) for s in rates],
        "rate_search": rate_search,
    }
