"""First chunks between the Euler steps of a running call (`Token2WavService(first_chunks_between_steps=True)`).

With a fake engine whose calls stop before each step until the test lets them go: a new stream's first chunk is
answered while a call of later chunks is mid-solve, and without the option it waits for the whole call. On the
tiny model, with the flow-cache step graphs' static buffers in use (emulated on CPU): a call of first chunks run
inside another call's solve changes neither call's audio."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from cosyvoice2.streaming import Chunk
from cosyvoice2_serving.token2wav import Token2WavService, Work
from tests.serving.test_token2wav_service import tiny_token2wav  # noqa: F401 - the shared module fixture
from tests.serving.test_token2wav_steps import AUDIO_ATOL, alone, chunked_engine, plan, until, voice  # noqa: F401

FIRST = Chunk(start=0, stop=4, feed=7, final=False)
SECOND = Chunk(start=4, stop=8, feed=11, final=False)
STEPS = 10


class SteppingEngine:
    """A fake engine whose calls run STEPS steps; before each it calls the scheduler's hook, then waits for the
    test's permit (first-chunk calls run through). Each job's audio is its chunk start."""

    runs_between_steps = True

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.log: list[tuple[str, list]] = []
        self.mid_call = threading.Event()
        self.held = 0  # steps of later-chunk calls that reached their permit (their hook already ran)

    def open(self, prompt, seed):
        return {"seed": seed}

    def run(self, work, between_steps=None):
        jobs = [(item.state["seed"], item.chunk.start) for item in work]
        self.log.append(("start", jobs))
        later = all(item.chunk.start > 0 for item in work)
        for _ in range(STEPS):
            if between_steps is not None:
                between_steps()
            if later:
                self.held += 1
                self.mid_call.set()
                assert self.permits.acquire(timeout=60), "test never released a step"
        self.log.append(("end", jobs))
        return [np.full(1, item.chunk.start, dtype=np.float32) for item in work]


@pytest.mark.parametrize("between_steps", [True, False])
def test_a_first_chunk_runs_between_the_steps_of_a_running_call(between_steps: bool) -> None:
    engine = SteppingEngine()

    async def scenario() -> None:
        service = Token2WavService(engine, first_chunks_between_steps=between_steps)
        try:
            assert service.first_chunks_between_steps == between_steps
            a0 = asyncio.ensure_future(service.process("A", np.arange(7), voice(0), FIRST, seed=1))
            assert (await a0)[0] == 0
            a1 = asyncio.ensure_future(service.process("A", np.arange(4), None, SECOND, seed=1))
            await until(engine.mid_call.is_set)  # A's later chunk is mid-solve, held before a step
            engine.permits.release(2)
            # B is queued only once A holds before its third step, whose hook has run: however slow the worker
            # thread, no earlier hook can take B, so the hook that runs it is the one after the next permit.
            await until(lambda: engine.held == 3)
            b0 = asyncio.ensure_future(service.process("B", np.arange(7), voice(1), FIRST, seed=2))
            await until(lambda: any(job.request_id == "B" for job in service._pending))  # B is queued
            engine.permits.release(1)  # one more step: the hook before the next one sees B waiting
            if between_steps:
                assert (await asyncio.wait_for(b0, 30))[0] == 0
                assert not a1.done()
            else:
                await asyncio.sleep(0.3)
                assert not b0.done()  # waits for the whole call of A's chunk
            engine.permits.release(STEPS)
            assert (await a1)[0] == 4
            await b0
            calls = service.stats.get("token2wav_calls_between_steps_total")
            assert calls == (1 if between_steps else 0)
        finally:
            engine.permits.release(100)
            service.shutdown()

    asyncio.run(scenario())
    starts = [jobs for what, jobs in engine.log if what == "start"]
    assert starts == [[(1, 0)], [(1, 4)], [(2, 0)]]
    if between_steps:  # B started and ended inside A's call
        assert engine.log.index(("end", [(2, 0)])) < engine.log.index(("end", [(1, 4)]))
    else:
        assert engine.log.index(("start", [(2, 0)])) > engine.log.index(("end", [(1, 4)]))


def test_an_engine_without_the_hook_keeps_whole_calls() -> None:
    class Plain(SteppingEngine):
        runs_between_steps = False

    service = Token2WavService(Plain(), first_chunks_between_steps=True)
    try:
        assert not service.first_chunks_between_steps
    finally:
        service.shutdown()


def test_a_call_inside_another_calls_solve_changes_neither(chunked_engine) -> None:  # noqa: F811
    engine, schedule = chunked_engine
    graphs = engine.engine.cached.graphs
    graphs.emulate = True  # the static buffers and buckets of the CUDA graphs, run eagerly on CPU
    try:
        rng = np.random.default_rng(9)
        a_prompt, b_prompt = voice(31), voice(32)
        a_tokens = rng.integers(0, 100, 40).astype(np.int32)
        b_tokens = rng.integers(0, 100, 30).astype(np.int32)
        a_chunks, b_chunks = plan(schedule, a_prompt, a_tokens.size), plan(schedule, b_prompt, b_tokens.size)
        want_a = alone(engine, a_prompt, a_tokens, a_chunks, 3)
        want_b = alone(engine, b_prompt, b_tokens, b_chunks, 4)

        a = engine.open(a_prompt, 3)
        first_a = engine.run([Work(a, a_tokens[: a_chunks[0].feed], a_chunks[0])])[0]
        b = engine.open(b_prompt, 4)
        inner: list = []

        def hook() -> None:
            if not inner:  # once, before the first Euler step of A's second chunk
                inner.append(engine.run([Work(b, b_tokens[: b_chunks[0].feed], b_chunks[0])])[0])

        second_a = engine.run([Work(a, a_tokens[a_chunks[0].feed : a_chunks[1].feed], a_chunks[1])],
                              between_steps=hook)[0]
        assert len(inner) == 1
        for have, want in ((first_a, want_a[0]), (second_a, want_a[1]), (inner[0], want_b[0])):
            assert not isinstance(have, Exception), have
            np.testing.assert_allclose(have, want, atol=AUDIO_ATOL)
    finally:
        graphs.emulate = False


@pytest.mark.parametrize("first_chunk_seconds, runs_between", [(100.0, True), (0.001, False)])
def test_a_first_chunk_waits_when_a_running_stream_is_about_to_run_dry(first_chunk_seconds, runs_between) -> None:
    """A's first chunk gave its listener `first_chunk_seconds` of audio; while A's second chunk is mid-solve, B's
    first chunk runs between the steps only if A still has enough buffered to wait for it."""
    rate = 1000

    class Timed(SteppingEngine):
        sample_rate = rate

        def run(self, work, between_steps=None):
            out = super().run(work, between_steps)
            return [np.zeros(int(first_chunk_seconds * rate) if item.chunk.start == 0 else 10, np.float32)
                    for item, _ in zip(work, out)]

    engine = Timed()

    async def scenario() -> tuple[float, float]:
        service = Token2WavService(engine, first_chunks_between_steps=True)
        try:
            await service.process("A", np.arange(7), voice(0), FIRST, seed=1)
            a1 = asyncio.ensure_future(service.process("A", np.arange(4), None, SECOND, seed=1))
            await until(engine.mid_call.is_set)
            b0 = asyncio.ensure_future(service.process("B", np.arange(7), voice(1), FIRST, seed=2))
            await until(lambda: any(job.request_id == "B" for job in service._pending))
            engine.permits.release(1)
            await asyncio.sleep(0.3)
            assert b0.done() == runs_between
            engine.permits.release(STEPS)
            await a1
            await b0
            return (service.stats.get("token2wav_calls_between_steps_total"),
                    service.stats.get("token2wav_between_steps_deferred_total"))
        finally:
            engine.permits.release(100)
            service.shutdown()

    ran, deferred = asyncio.run(scenario())
    assert (ran, deferred > 0) == ((1, False) if runs_between else (0, True))


def test_a_stream_closed_mid_chunk_leaves_no_playback_record() -> None:
    class Timed(SteppingEngine):
        sample_rate = 1000

    engine = Timed()

    async def scenario() -> Token2WavService:
        service = Token2WavService(engine, first_chunks_between_steps=True)
        try:
            await service.process("A", np.arange(7), voice(0), FIRST, seed=1)
            assert set(service._playback) == {"A"}  # the first chunk's audio is being played
            a1 = asyncio.ensure_future(service.process("A", np.arange(4), None, SECOND, seed=1))
            await until(engine.mid_call.is_set)
            assert service.close_stream("A")  # the client left while its chunk runs
            engine.permits.release(STEPS)
            await a1
            return service
        finally:
            engine.permits.release(100)
            service.shutdown()

    service = asyncio.run(scenario())
    assert service._playback == {} and service.active_streams() == set()
