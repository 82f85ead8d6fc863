"""Which pending token2wav jobs the next engine call runs, most urgent first (pure: no threads, clock or torch).

The token2wav service runs one call at a time; when it forms the next call, each stream offers its oldest pending
job (a stream's chunks stay in order) and this policy ranks them:

1. **Starving**: a stream whose listener runs out of buffered audio within `starving_calls` expected call times
   (its deadline lies before now + starving_calls x the expected call time). With 1, that would be a stream that
   runs dry before even this call could finish: a gap is then certain. With 2, a stream that cannot wait for the
   next call (the next one forms only when this one ends). The served default is 3: the margin covers calls that
   take longer than expected (more rows, the GPU shared with the LLM); the expected call time is the service's
   (`CallTimes`: what calls of as many rows as are pending took). A job with nothing playing that is not a first chunk (an
   offline utterance) counts as starving once its deadline has passed, so a stream of first chunks cannot hold it
   back for ever.
2. **First chunks**: a new stream's listener hears nothing until its first chunk is answered, while a stream
   past its first chunk is already playing and has slack; so a first chunk goes into the very next call, ahead
   of any later chunk that still has audio buffered.
3. **The rest, earliest deadline first**: the deadline of a playing stream is when its buffered audio runs out.
   A job with nothing playing (an offline utterance, or a stream whose audio the service cannot time) has the
   deadline `queued_at + max_defer_s`, so it waits at most about that long behind playing streams.

Within a rank, earlier deadline first, and jobs with equal keys keep the order they are given in (arrival).
While first chunks wait, a call holds only ranks 1 and 2: later chunks with audio to spare would only lengthen
it (measured: first chunks in calls of their own took the c=16 first chunk from 1185 to 835 ms on an H200).
A call takes at most `max_rows` jobs - the engine's largest CUDA-graph bucket of rows, beyond which its calls
would run eagerly - and what does not fit waits for the next call, ranked again then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class Urgency(enum.IntEnum):
    """A pending job's rank; a lower value runs first."""

    STARVING = 0
    FIRST_CHUNK = 1
    SCHEDULED = 2


@dataclass(frozen=True)
class PendingJob:
    """What the policy knows of one stream's oldest pending job."""

    queued_at: float  # when the job arrived (time.monotonic())
    first_chunk: bool  # the first chunk of a new stream (its listener hears nothing yet)
    runs_dry_at: float | None = None  # when the stream's buffered audio runs out; None: nothing is playing


@dataclass(frozen=True)
class SchedulePolicy:
    """Deadline order of the next call's jobs (module docstring)."""

    max_rows: int | None = None  # jobs per call at most; None: no cap
    max_defer_s: float = 0.25  # how long a job with nothing playing may wait behind playing streams
    #: Expected call times of buffered audio below which a playing stream is starving (module docstring). Under
    #: open-loop load first chunks wait almost always, so a later chunk goes into a call only once starving: with
    #: 1 it then arrived just after its listener ran dry (every stall one H200 showed at 12-24 requests/s). 3 against
    #: 1 on one H200, two interleaved runs: sustained open-loop rate 17.5 / >= 14 against 14 / 12.25 requests/s,
    #: stalled streams at 28 requests/s 20 / 28 against 238, at 21 requests/s 11 / 10 against 16; c=16, c=32 unchanged
    #: (docs/experiments/2026-12-02-h200-open-loop.md).
    starving_calls: float = 3.0

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {self.max_rows}")
        if self.max_defer_s < 0:
            raise ValueError(f"max_defer_s must not be negative, got {self.max_defer_s}")
        if not self.starving_calls >= 1:
            raise ValueError(f"starving_calls must be at least 1 (this call), got {self.starving_calls}")

    def deadline(self, job: PendingJob) -> float:
        """When the job is due: its stream's audio runs out, or (nothing playing) `max_defer_s` after its arrival."""
        return job.runs_dry_at if job.runs_dry_at is not None else job.queued_at + self.max_defer_s

    def urgency(self, job: PendingJob, now: float, call_s: float) -> Urgency:
        """The job's rank if the next call starts at `now` and takes `call_s`."""
        if job.runs_dry_at is not None and job.runs_dry_at < now + self.starving_calls * call_s:
            return Urgency.STARVING
        if job.first_chunk:
            return Urgency.FIRST_CHUNK
        if job.runs_dry_at is None and self.deadline(job) < now:  # waited past `max_defer_s`
            return Urgency.STARVING
        return Urgency.SCHEDULED

    def order(self, jobs: Sequence[PendingJob], now: float, call_s: float) -> list[int]:
        """Indices of `jobs`, most urgent first (a stable sort: ties keep the given order)."""
        keys = [(self.urgency(job, now, call_s), self.deadline(job)) for job in jobs]
        return sorted(range(len(jobs)), key=keys.__getitem__)

    def call_rows(self, pending: int) -> int:
        """The jobs a call of `pending` pending jobs would hold at most (the row cap)."""
        return pending if self.max_rows is None else min(pending, self.max_rows)

    def next_call(self, jobs: Sequence[PendingJob], now: float, call_s: float) -> list[int]:
        """Indices of the jobs the next call runs, in `order`, at most `max_rows` of them. While first chunks wait,
        the call runs only them and the starving jobs: a later chunk with audio to spare would make the call, and
        so every first chunk in it, slower (a call's time grows with its rows)."""
        urgencies = [self.urgency(job, now, call_s) for job in jobs]
        ranked = self.order(jobs, now, call_s)
        if Urgency.FIRST_CHUNK in urgencies:
            ranked = [i for i in ranked if urgencies[i] <= Urgency.FIRST_CHUNK]
        return ranked if self.max_rows is None else ranked[: self.max_rows]


class CallTimes:
    """How long the next engine call will take: running estimates over the calls timed so far (pure: the caller
    times them): a running least-squares line of seconds against the call's rows (`weight` for the newest call),
    so that the call a queue of first chunks is about to fill is expected to take what full calls took, not the
    mean of small and full ones (until calls of at least two sizes were seen it answers their running mean).
    Measured against that running mean alone in the served stack (one H200, three runs each): the open-loop rate
    with continuous playback 21 req/s against 14 (docs/experiments/2026-12-02-h200-call-estimate.md)."""

    def __init__(self, initial_s: float, weight: float) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.mean_s = initial_s
        # decayed sums of 1, rows, rows^2, seconds, rows x seconds (the line's normal equations)
        self._n = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        w = self.weight
        self.mean_s = (1.0 - w) * self.mean_s + w * seconds
        keep = 1.0 - w
        self._n = keep * self._n + 1.0
        self._x = keep * self._x + rows
        self._xx = keep * self._xx + rows * rows
        self._y = keep * self._y + seconds
        self._xy = keep * self._xy + rows * seconds

    def expected(self, rows: int) -> float:
        """The expected seconds of a call of `rows` jobs."""
        spread = self._n * self._xx - self._x * self._x  # n^2 x the variance of the rows seen
        if spread <= 1e-9 * max(1.0, self._n * self._xx):
            return self.mean_s
        slope = max(0.0, (self._n * self._xy - self._x * self._y) / spread)
        mean_rows, mean_s = self._x / self._n, self._y / self._n
        return max(0.0, mean_s + slope * (rows - mean_rows))
