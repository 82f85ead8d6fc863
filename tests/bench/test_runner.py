import asyncio

import numpy as np
import pytest

from gateway.services.voices import Voice
from ttsbench.inputs import BenchRequest
from ttsbench.runner import measure, run_level


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
