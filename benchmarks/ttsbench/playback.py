"""What a listener hears: playback stalls of a stream, from chunk arrival times and chunk durations (pure).

Model: playback starts the moment the first audio arrives and plays continuously; whenever the audio
received so far has finished playing before the next chunk arrives, the listener hears silence (a stall)
until that chunk arrives, and playback resumes from there. Pieces that carry no audio (a container
header, an encoder still filling its first frame) neither start playback nor end a stall.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ttsbench.stats import percentile


@dataclass(frozen=True)
class StreamStalls:
    """Stalls of one stream: how many times playback ran dry, and for how long in all (seconds)."""

    count: int
    seconds: float
    #: For each stall, the audio piece that came too late, numbered from 1 among the pieces that carry audio (2: the
    #: second chunk arrived after the first had played): where in the stream the server fell behind.
    late_pieces: tuple[int, ...] = ()


def stream_stalls(arrivals: Sequence[float], durations: Sequence[float]) -> StreamStalls:
    """Stalls of one stream given each piece's arrival time and its audio duration (both in seconds)."""
    if len(arrivals) != len(durations):
        raise ValueError(f"{len(arrivals)} arrival times but {len(durations)} durations")
    if any(d < 0 for d in durations):
        raise ValueError("audio durations must be >= 0")
    if any(later < earlier for earlier, later in zip(arrivals, arrivals[1:])):
        raise ValueError("arrival times must not decrease")
    played_until: float | None = None  # when the audio received so far ends; None before any audio
    count, total, piece, late = 0, 0.0, 0, []
    for arrival, duration in zip(arrivals, durations, strict=True):
        if duration == 0:
            continue
        piece += 1
        if played_until is None:
            played_until = arrival
        elif arrival > played_until:
            count += 1
            total += arrival - played_until
            late.append(piece)
            played_until = arrival
        played_until += duration
    return StreamStalls(count, total, tuple(late))


@dataclass(frozen=True)
class StallSummary:
    """Stalls over the streams of one level. Times are seconds (the report shows milliseconds)."""

    streams: int
    #: Streams that stalled at least once.
    stalled: int
    #: Stall events over all streams.
    events: int
    #: Total stall time summed over all streams, and its percentiles/maximum over the streams.
    total: float
    p50: float
    p90: float
    max: float
    #: Stall events by the audio piece that came too late (`StreamStalls.late_pieces`), ascending by piece.
    by_piece: dict[int, int] = field(default_factory=dict)

    @property
    def stalled_share(self) -> float:
        return self.stalled / self.streams if self.streams else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "stalled_share": self.stalled_share}

    def describe_pieces(self) -> str:
        """Where the stalls fall, e.g. "at chunk 2: 3, chunk 4: 1" ("" without stalls)."""
        if not self.by_piece:
            return ""
        return "at " + ", ".join(f"chunk {piece}: {events}" for piece, events in self.by_piece.items())


def summarize_stalls(streams: Sequence[StreamStalls]) -> StallSummary | None:
    """Summary over streams; None when there are none (nothing streamed, or every request failed)."""
    if not streams:
        return None
    seconds = [s.seconds for s in streams]
    return StallSummary(
        streams=len(streams),
        stalled=sum(1 for s in streams if s.count),
        events=sum(s.count for s in streams),
        total=math.fsum(seconds),
        p50=percentile(seconds, 50),
        p90=percentile(seconds, 90),
        max=max(seconds),
        by_piece=dict(sorted(Counter(piece for s in streams for piece in s.late_pieces).items())),
    )
