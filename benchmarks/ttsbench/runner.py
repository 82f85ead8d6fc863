"""Load shapes, timing every audio piece: closed loop (N workers, each with one request in flight) and open loop
(requests sent at Poisson arrival times, however many are still running)."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import numpy as np

from ttsbench.arrivals import draw_requests, poisson_arrivals
from ttsbench.inputs import BenchRequest
from ttsbench.report import LevelResult, RateResult, RequestRecord

#: What a target yields as audio arrives: a float32 array (Triton) or response bytes (HTTP).
AudioPiece = np.ndarray | bytes


class Target(Protocol):
    """One way of asking the service for speech. Targets only talk; the runner keeps time."""

    mode: str

    def synthesize(self, request: BenchRequest) -> AsyncIterator[AudioPiece]:
        """Send one request and yield its audio pieces as they arrive; raise on failure."""
        ...

    def chunk_seconds(self, pieces: Sequence[AudioPiece]) -> list[float]:
        """Audio duration each piece of a finished response carries (called after its timing ended)."""
        ...

    async def aclose(self) -> None: ...


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[object]]


async def measure(target: Target, request: BenchRequest, timeout: float, clock: Clock = time.perf_counter) -> tuple[float, RequestRecord]:
    """Send one request; return its send time and its record (failures become records too)."""
    start = clock()
    offsets: list[float] = []
    pieces: list[AudioPiece] = []

    async def consume() -> None:
        async for piece in target.synthesize(request):
            if len(piece):
                offsets.append(clock() - start)
                pieces.append(piece)

    try:
        await asyncio.wait_for(consume(), timeout)
    except Exception as exc:  # noqa: BLE001 - any failure of one request is a counted error
        total = clock() - start
        message = "timeout" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
        return start, RequestRecord(request.id, tuple(offsets), total, 0.0, error=message)
    total = clock() - start
    try:
        seconds = target.chunk_seconds(pieces)
    except Exception as exc:  # noqa: BLE001 - audio that does not decode is a failed request, not a failed run
        return start, RequestRecord(request.id, tuple(offsets), total, 0.0, error=f"undecodable audio: {exc}")
    return start, RequestRecord(request.id, tuple(offsets), total, math.fsum(seconds), chunk_seconds=tuple(seconds))


async def _drive(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int,
    keep_going: Callable[[int], bool],
    timeout: float,
    clock: Clock,
) -> tuple[list[float], list[float], list[RequestRecord]]:
    """Run workers until ``keep_going(index)`` says stop; request i uses item ``i % len``."""
    counter = itertools.count()
    starts: list[float] = []
    ends: list[float] = []
    records: list[RequestRecord] = []

    async def worker() -> None:
        while keep_going(index := next(counter)):
            start, record = await measure(target, requests[index % len(requests)], timeout, clock)
            starts.append(start)
            ends.append(start + record.total)
            records.append(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return starts, ends, records


async def run_level(
    target: Target,
    requests: Sequence[BenchRequest],
    concurrency: int,
    *,
    num_requests: int | None = None,
    duration: float | None = None,
    warmup_per_worker: int = 1,
    timeout: float = 300.0,
    clock: Clock = time.perf_counter,
) -> LevelResult:
    """Warm up (discarded), then measure either ``num_requests`` requests or ``duration`` seconds.

    In duration mode no request starts after the deadline; those in flight finish and count.
    """
    if not requests:
        raise ValueError("no requests to send")
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if (num_requests is None) == (duration is None):
        raise ValueError("give exactly one of num_requests and duration")

    warmups = concurrency * warmup_per_worker
    if warmups:
        await _drive(target, requests, concurrency, lambda i: i < warmups, timeout, clock)

    if num_requests is not None:
        keep_going: Callable[[int], bool] = lambda i: i < num_requests  # noqa: E731
    else:
        deadline = clock() + duration  # type: ignore[operator]
        keep_going = lambda _i: clock() < deadline  # noqa: E731
    window_start = time.time()  # wall clock, for matching outside samples (GPU use) to this level
    starts, ends, records = await _drive(target, requests, concurrency, keep_going, timeout, clock)
    wall = max(ends) - min(starts) if records else 0.0
    return LevelResult(target.mode, concurrency, wall, tuple(records), window=(window_start, time.time()))


async def run_open_loop(
    target: Target,
    requests: Sequence[BenchRequest],
    rate: float,
    *,
    num_requests: int | None = None,
    duration: float | None = None,
    seed: int = 0,
    timeout: float = 300.0,
    clock: Clock = time.perf_counter,
    sleep: Sleep = asyncio.sleep,
) -> RateResult:
    """Open loop at ``rate`` requests per second: Poisson arrivals (``num_requests`` of them, or all within
    ``duration`` seconds), each a request drawn from ``requests``, sent at its arrival time as a task of its own.

    Arrivals never wait for earlier requests: whatever the server's backlog, the next request goes out on time
    (``send_lags`` tells how late the event loop managed). After the last arrival, every request still running is
    awaited (each has its ``timeout``), so the next rate starts against an idle server. No warm-up here: a caller
    warms the server once before its first rate.
    """
    if not requests:
        raise ValueError("no requests to send")
    arrivals = poisson_arrivals(rate, seed, count=num_requests, duration=duration)
    picks = draw_requests(requests, len(arrivals), seed)
    in_flight = max_in_flight = 0

    async def send(request: BenchRequest) -> tuple[float, RequestRecord]:
        nonlocal in_flight, max_in_flight
        in_flight += 1
        max_in_flight = max(max_in_flight, in_flight)
        try:
            return await measure(target, request, timeout, clock)
        finally:
            in_flight -= 1

    window_start = time.time()
    origin = clock()
    tasks: list[asyncio.Task[tuple[float, RequestRecord]]] = []
    try:
        for at, request in zip(arrivals, picks, strict=True):
            # always yield, even when behind: the requests created so far start now, not after the last arrival
            await sleep(max(origin + at - clock(), 0.0))
            tasks.append(asyncio.create_task(send(request)))
        done = await asyncio.gather(*tasks)
    finally:  # interrupted: no request of this rate outlives it
        for task in tasks:
            task.cancel()
    starts = [start for start, _ in done]
    records = tuple(record for _, record in done)
    ends = [start + record.total for start, record in done]
    return RateResult(
        mode=target.mode,
        rate=rate,
        seed=seed,
        # count mode: the span up to the last send is the sample's own (a Poisson sample of n arrivals spans n / rate
        # on average); duration mode: the whole duration, quiet stretches at either end included
        arrival_seconds=duration if duration is not None else (max(starts) - origin if starts else 0.0),
        wall_seconds=max(ends) - min(starts) if done else 0.0,
        records=records,
        send_lags=tuple(start - (origin + at) for (start, _), at in zip(done, arrivals, strict=True)),
        max_in_flight=max_in_flight,
        window=(window_start, time.time()),
    )
