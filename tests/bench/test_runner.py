import asyncio
import time

import numpy as np
import pytest

from gateway.services.voices import Voice
from ttsbench.arrivals import draw_requests, poisson_arrivals
from ttsbench.inputs import BenchRequest
from ttsbench.report import summarize_rate
from ttsbench.runner import measure, run_level, run_open_loop


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedTarget:
    """Yields pieces of ``piece_samples`` samples, advancing a fake clock by ``step`` before each."""

    mode = "fake/streaming"

    def __init__(self, clock=None, pieces=(4800, 0, 2400), step=0.1, fail_on=None, hang_on=None):
        self.clock, self.pieces, self.step = clock, pieces, step
        self.fail_on, self.hang_on = fail_on, hang_on
        self.sent: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def synthesize(self, request):
        self.sent.append(request.id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if request.id == self.hang_on:
                await asyncio.sleep(3600)
            for i, n in enumerate(self.pieces):
                if self.clock is not None:
                    self.clock.now += self.step
                else:
                    await asyncio.sleep(0.001)
                if request.id == self.fail_on and i == 1:
                    raise RuntimeError("server said no")
                yield np.zeros(n, np.float32)
        finally:
            self.in_flight -= 1

    def chunk_seconds(self, pieces):
        return [p.size / 24_000 for p in pieces]

    async def aclose(self):
        pass


def _requests(n):
    voice = Voice("voice_x", "x", "hello", np.zeros(1600, np.float32))
    return [BenchRequest(f"r{i}", voice, f"text {i}") for i in range(n)]


async def test_measure_times_each_non_empty_piece():
    clock = FakeClock()
    target = ScriptedTarget(clock, pieces=(4800, 0, 2400), step=0.1)
    start, record = await measure(target, _requests(1)[0], timeout=5, clock=clock)
    assert start == 100.0
    assert record.chunk_offsets == pytest.approx((0.1, 0.3))  # the empty piece is not a chunk
    assert record.total == pytest.approx(0.3)
    assert record.audio_seconds == pytest.approx(0.3)
    assert record.chunk_seconds == pytest.approx((0.2, 0.1))  # one duration per timed piece
    assert record.error is None


async def test_measure_turns_failures_into_error_records():
    clock = FakeClock()
    target = ScriptedTarget(clock, fail_on="r0")
    _, record = await measure(target, _requests(1)[0], timeout=5, clock=clock)
    assert record.error == "RuntimeError: server said no"
    assert record.chunk_offsets == pytest.approx((0.1,)) and record.audio_seconds == 0.0


async def test_measure_counts_undecodable_audio_as_an_error():
    clock = FakeClock()
    target = ScriptedTarget(clock)
    target.chunk_seconds = lambda pieces: (_ for _ in ()).throw(ValueError("not an mp3"))
    _, record = await measure(target, _requests(1)[0], timeout=5, clock=clock)
    assert record.error == "undecodable audio: not an mp3" and record.audio_seconds == 0.0
    assert record.chunk_offsets == pytest.approx((0.1, 0.3))


async def test_measure_timeout():
    target = ScriptedTarget(hang_on="r0")
    _, record = await measure(target, _requests(1)[0], timeout=0.05)
    assert record.error == "timeout"
    assert target.in_flight == 0  # the abandoned request was cancelled


async def test_run_level_counts_warmup_separately_and_cycles_inputs():
    target = ScriptedTarget()
    result = await run_level(target, _requests(3), concurrency=2, num_requests=7, warmup_per_worker=2)
    assert len(target.sent) == 4 + 7
    assert len(result.records) == 7
    assert sorted(r.item_id for r in result.records) == sorted(["r0", "r1", "r2"] * 2 + ["r0"])
    assert target.max_in_flight == 2
    assert result.mode == "fake/streaming" and result.concurrency == 2
    assert result.wall_seconds > 0
    assert all(r.first_chunk <= r.total for r in result.records)
    start, end = result.window  # the measured part only, in wall-clock time
    assert end - start >= result.wall_seconds * 0.5 and end >= start


async def test_run_level_records_errors_and_keeps_going():
    target = ScriptedTarget(fail_on="r1")
    result = await run_level(target, _requests(3), concurrency=1, num_requests=6, warmup_per_worker=0)
    errors = [r for r in result.records if r.error]
    assert [r.item_id for r in errors] == ["r1", "r1"]
    assert len(result.records) == 6


async def test_run_level_duration_mode_stops_starting_requests():
    target = ScriptedTarget()
    result = await run_level(target, _requests(2), concurrency=3, duration=0.05, warmup_per_worker=0)
    assert len(result.records) >= 3
    assert len(target.sent) == len(result.records)


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_requests=None, duration=None), dict(num_requests=1, duration=1.0), dict(num_requests=1, concurrency=0)],
)
async def test_run_level_rejects_bad_settings(kwargs):
    kwargs.setdefault("concurrency", 1)
    with pytest.raises(ValueError):
        await run_level(ScriptedTarget(), _requests(1), **kwargs)


class FakeSleep:
    """Like asyncio.sleep on a FakeClock: the tasks that are ready run now, then the time passes at once."""

    def __init__(self, clock):
        self.clock = clock

    async def __call__(self, seconds):
        await asyncio.sleep(0)
        self.clock.now += seconds


async def test_open_loop_sends_each_request_at_its_arrival_time_drawn_from_the_mix():
    clock = FakeClock()
    target = ScriptedTarget(clock, pieces=(2400, 2400), step=0.0)
    mix = _requests(5)
    result = await run_open_loop(target, mix, rate=4.0, num_requests=12, seed=9, clock=clock, sleep=FakeSleep(clock))
    arrivals = poisson_arrivals(4.0, 9, count=12)
    assert [r.item_id for r in result.records] == [r.id for r in draw_requests(mix, 12, 9)]
    assert result.send_lags == pytest.approx([0.0] * 12, abs=1e-9)  # each went out exactly when it arrived
    assert result.arrival_seconds == pytest.approx(arrivals[-1])
    assert (result.rate, result.seed, result.mode) == (4.0, 9, "fake/streaming")
    summary = summarize_rate(result)
    assert summary.achieved_rate == pytest.approx(12 / arrivals[-1])
    assert summary.requests == 12 and summary.errors == 0 and summary.stalls.streams == 12


async def test_open_loop_duration_sends_every_arrival_before_it_and_counts_errors():
    clock = FakeClock()
    target = ScriptedTarget(clock, step=0.0, fail_on="r1")
    mix = _requests(3)
    result = await run_open_loop(target, mix, rate=10.0, duration=3.0, seed=2, clock=clock, sleep=FakeSleep(clock))
    expected = draw_requests(mix, len(poisson_arrivals(10.0, 2, duration=3.0)), 2)
    assert len(result.records) == len(expected) > 10
    summary = summarize_rate(result)
    assert summary.errors == sum(r.id == "r1" for r in expected) > 0
    assert summary.achieved_rate == pytest.approx(len(expected) / 3.0)  # over the whole duration


class SlowTarget:
    """Every request takes ``seconds`` (real time) before its one chunk; records when each was sent and done."""

    mode = "slow/streaming"

    def __init__(self, seconds):
        self.seconds = seconds
        self.sent: list[float] = []
        self.done: list[float] = []

    async def synthesize(self, request):
        self.sent.append(time.perf_counter())
        await asyncio.sleep(self.seconds)
        self.done.append(time.perf_counter())
        yield np.zeros(24_000, np.float32)

    def chunk_seconds(self, pieces):
        return [p.size / 24_000 for p in pieces]

    async def aclose(self):
        pass


async def test_open_loop_arrivals_do_not_wait_for_running_requests():
    target = SlowTarget(seconds=1.0)
    started = time.perf_counter()
    # 10 arrivals at 100/s come within about 0.1 s; a generator that waited for running requests would need 10 s
    result = await run_open_loop(target, _requests(3), rate=100.0, num_requests=10, seed=0)
    elapsed = time.perf_counter() - started
    assert len(result.records) == 10 and all(r.ok for r in result.records)
    assert result.max_in_flight == 10
    assert max(target.sent) < min(target.done)  # every request was out before the first one finished
    assert elapsed < 5.0
    assert min(r.first_chunk for r in result.records) >= 0.9


async def test_open_loop_drains_what_is_running_and_leaves_nothing_behind():
    target = ScriptedTarget(hang_on="r0")
    result = await run_open_loop(target, _requests(1), rate=50.0, num_requests=3, seed=1, timeout=0.05)
    assert [r.error for r in result.records] == ["timeout"] * 3
    assert target.in_flight == 0
