"""Token2WavService with a first-chunk worker: first chunks run on their own worker, concurrently with calls of
later chunks, and each stream's chunks still run one at a time and in order.

With fake engines whose calls block until the test lets them go: a new stream's first chunk is answered while
a call of later chunks is still running (one worker would make it wait), and a stream's second chunk does not
start before its first one is answered. On the tiny model: a stream whose first chunk ran on one lane and whose
later chunks run on the other (`BatchedToken2Wav.lane`) gets the audio it gets on one engine, the lanes share
the voice prefixes and the flow-cache budget, and every byte they hold is given back at the end."""

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


class BlockingEngine:
    """A fake engine: each call records its jobs (stream id via the state, chunk start), then waits for the
    test's permit, then answers each job with its chunk start as audio."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.permits = threading.Semaphore(0)
        self.running = threading.Event()

    def open(self, prompt, seed):
        return {"seed": seed}

    def run(self, work):
        self.log.append((self.name, [(item.state["seed"], item.chunk.start) for item in work]))
        self.running.set()
        assert self.permits.acquire(timeout=60), "test never let the call finish"
        self.running.clear()
        return [np.full(1, item.chunk.start, dtype=np.float32) for item in work]


def test_a_first_chunk_is_answered_while_a_call_of_later_chunks_runs() -> None:
    log: list = []
    later, first = BlockingEngine("later", log), BlockingEngine("first", log)

    async def scenario() -> None:
        service = Token2WavService(later, first_chunk_engine=first)
        try:
            assert service.first_chunk_worker
            prompt = voice(0)
            # stream A: its first chunk on the first-chunk worker
            a0 = asyncio.ensure_future(service.process("A", np.arange(7), prompt, FIRST, seed=1))
            await until(first.running.is_set)
            # A's second chunk is queued while its first still runs: it must wait for it (order per stream)
            a1 = asyncio.ensure_future(service.process("A", np.arange(4), None, SECOND, seed=1))
            await asyncio.sleep(0.2)
            assert not later.running.is_set(), "a stream's second chunk started before its first was answered"
            first.permits.release()
            assert (await a0)[0] == 0
            await until(later.running.is_set)  # A's second chunk now runs on the other worker, and blocks there
            # a new stream's first chunk does not wait for that call
            b0 = asyncio.ensure_future(service.process("B", np.arange(7), prompt, FIRST, seed=2))
            await until(first.running.is_set)
            first.permits.release()
            assert (await asyncio.wait_for(b0, 30))[0] == 0
            assert not a1.done()
            later.permits.release()
            assert (await a1)[0] == 4
            assert service.stats.get("token2wav_first_chunk_calls_total") == 2
        finally:
            for engine in (first, later):
                engine.permits.release()
            service.shutdown()

    asyncio.run(scenario())
    assert log == [("first", [(1, 0)]), ("later", [(1, 4)]), ("first", [(2, 0)])]


def test_one_worker_makes_the_first_chunk_wait_for_the_running_call() -> None:
    """The same arrival with no first-chunk worker: B's first chunk waits (the case the worker exists for)."""
    log: list = []
    engine = BlockingEngine("only", log)

    async def scenario() -> None:
        service = Token2WavService(engine)
        try:
            assert not service.first_chunk_worker
            a0 = asyncio.ensure_future(service.process("A", np.arange(7), voice(0), FIRST, seed=1))
            await until(engine.running.is_set)
            engine.permits.release()
            await a0
            a1 = asyncio.ensure_future(service.process("A", np.arange(4), None, SECOND, seed=1))
            await until(engine.running.is_set)
            b0 = asyncio.ensure_future(service.process("B", np.arange(7), voice(0), FIRST, seed=2))
            await asyncio.sleep(0.2)
            assert not b0.done() and len(log) == 2
            engine.permits.release()
            await a1
            await until(engine.running.is_set)
            engine.permits.release()
            await b0
        finally:
            engine.permits.release()
            service.shutdown()

    asyncio.run(scenario())


def test_step_scheduling_keeps_one_worker(chunked_engine) -> None:  # noqa: F811
    """Step scheduling already lets a first chunk join at the next step: no second worker."""
    engine, _ = chunked_engine
    service = Token2WavService(engine, scheduling="step", first_chunk_engine=engine.lane())
    try:
        assert service.scheduling == "step" and not service.first_chunk_worker
    finally:
        service.shutdown()


def test_lanes_share_the_voice_prefix_and_budget_and_give_the_same_audio(chunked_engine) -> None:  # noqa: F811
    engine, schedule = chunked_engine
    lane = engine.lane()
    assert lane.engine.cached is not engine.engine.cached  # own step graphs
    assert lane.engine.book is engine.engine.book  # shared prefixes and budget
    prompt, seed = voice(11), 5
    tokens = np.random.default_rng(3).integers(0, 100, 40).astype(np.int32)
    chunks = plan(schedule, prompt, tokens.size)
    assert len(chunks) >= 3
    expected = alone(engine, prompt, tokens, chunks, seed)
    assert engine.engine.cache_bytes == 0

    # the first chunk on the lane, the others on the engine: what the service's two workers do
    state = lane.open(prompt, seed)
    got, sent = [], 0
    for i, c in enumerate(chunks):
        runner = lane if i == 0 else engine
        result = runner.run([Work(state, tokens[sent : c.feed], c)])[0]
        assert not isinstance(result, Exception), result
        got.append(result)
        sent = c.feed
        if i == 0:
            assert engine.engine.cache_bytes > 0  # the lane's caches count against the shared budget
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, atol=AUDIO_ATOL)
    assert engine.engine.cache_bytes == 0
    assert len(engine.engine.book.prefixes) == 1  # one voice, one prefix for both lanes


def test_service_with_a_first_chunk_worker_on_the_tiny_model(chunked_engine) -> None:  # noqa: F811
    """Several streams at once through both workers: every chunk's audio equals the stream run alone."""
    engine, schedule = chunked_engine
    lane = engine.lane()
    rng = np.random.default_rng(7)
    streams = []
    for i in range(4):
        prompt = voice(20 + i)
        tokens = rng.integers(0, 100, 30 + 5 * i).astype(np.int32)
        streams.append((f"s{i}", prompt, tokens, plan(schedule, prompt, tokens.size), 100 + i))
    expected = {rid: alone(engine, p, t, c, seed) for rid, p, t, c, seed in streams}

    async def one(service, rid, prompt, tokens, chunks, seed):
        out, sent = [], 0
        for c in chunks:
            out.append(await service.process(rid, tokens[sent : c.feed], prompt if c.start == 0 else None, c, seed))
            sent = c.feed
        return rid, out

    async def scenario():
        service = Token2WavService(engine, first_chunk_engine=lane)
        try:
            results = await asyncio.gather(*(one(service, *s) for s in streams))
            assert service.active_streams() == set()
            assert service.stats.get("token2wav_first_chunk_calls_total") >= 1
            return dict(results)
        finally:
            service.shutdown()

    got = asyncio.run(scenario())
    for rid, audio in got.items():
        for want, have in zip(expected[rid], audio, strict=True):
            np.testing.assert_allclose(have, want, atol=AUDIO_ATOL)
    assert engine.engine.cache_bytes == 0


@pytest.mark.parametrize("first_chunks", [True, False])
def test_shutdown_answers_what_waits(first_chunks: bool) -> None:
    log: list = []
    later, first = BlockingEngine("later", log), BlockingEngine("first", log)

    async def scenario() -> None:
        service = Token2WavService(later, first_chunk_engine=first)
        job = asyncio.ensure_future(service.process("A", np.arange(7), voice(0), FIRST, seed=1))
        await until(first.running.is_set)
        queued = asyncio.ensure_future(service.process("A", np.arange(4), None, SECOND, seed=1))
        await asyncio.sleep(0.05)
        threading.Thread(target=service.shutdown).start()
        await asyncio.sleep(0.05)
        first.permits.release()
        await job
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(queued, 30)

    asyncio.run(scenario())
