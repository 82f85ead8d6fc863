"""Token2WavService in step mode: chunks advance one estimator step at a time across streams.

On the tiny model (BatchedToken2Wav, chunked flow caches) with a gate that lets the worker run one step at a
time: a new stream's first chunk joins at the next step while another stream's chunk is mid-solve, and both
get the audio they get alone; closing a stream mid-flight frees its row and caches; an engine error fails only
its rows. With a fake step engine: first chunks go first, and a later chunk is not starved by new streams."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from cosyvoice2.streaming import Chunk
from cosyvoice2_serving.errors import InvalidInput
from cosyvoice2_serving.orchestrator import PromptTensors
from cosyvoice2_serving.token2wav import Token2WavService, Work
from tests.serving.test_token2wav_service import tiny_token2wav  # noqa: F401 - the shared module fixture

AUDIO_ATOL = 2e-3  # the tiny random HiFT amplifies float rounding of the flow (tests/serving/test_batched_token2wav.py)
STEPS = 10  # Euler steps per chunk


class Gated:
    """Delegates to an engine; each `step` waits for a permit, so a test decides when the worker steps."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.permits = threading.Semaphore(0)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, handles):
        assert self.permits.acquire(timeout=60), "test never released a step"
        return self._engine.step(handles)

    def release(self, steps: int) -> None:
        for _ in range(steps):
            self.permits.release()


async def until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def voice(seed: int, tokens: int = 6) -> PromptTensors:
    rng = np.random.default_rng(seed)
    return PromptTensors(rng.integers(0, 100, tokens).astype(np.int32),
                         rng.standard_normal((2 * tokens, 80)).astype(np.float32),
                         rng.standard_normal(192).astype(np.float32))


@pytest.fixture(scope="module")
def chunked_engine(tiny_token2wav):  # noqa: F811
    from cosyvoice2_serving.engines import BatchedToken2Wav

    base, schedule = tiny_token2wav
    engine = BatchedToken2Wav(base.engine.flow, base.engine.hift, base.engine.config, schedule, "chunked")
    return engine, schedule


def plan(schedule, prompt: PromptTensors, n: int) -> list[Chunk]:
    return replace(schedule, prompt_tokens=prompt.speech_tokens.size).chunks(n)


def alone(engine, prompt: PromptTensors, tokens: np.ndarray, chunks: list[Chunk], seed: int) -> list[np.ndarray]:
    """Each chunk of one stream as a whole call of its own (call scheduling)."""
    state = engine.open(prompt, seed)
    out, sent = [], 0
    for c in chunks:
        result = engine.run([Work(state, tokens[sent : c.feed], c)])[0]
        assert not isinstance(result, Exception), result
        out.append(result)
        sent = c.feed
    return out


async def test_a_new_stream_joins_at_the_next_step_while_another_is_mid_utterance(chunked_engine):
    engine, schedule = chunked_engine
    pa, pb = voice(1), voice(2, tokens=9)
    ta, tb = np.arange(40, dtype=np.int32) % 97, (np.arange(30, dtype=np.int32) * 7) % 101
    ca, cb = plan(schedule, pa, 40), plan(schedule, pb, 30)
    gated = Gated(engine)
    service = Token2WavService(gated, max_defer_s=30.0, scheduling="step")
    assert service.scheduling == "step"
    try:
        gated.release(STEPS)
        a = [await service.process("A", ta[: ca[0].feed], pa, ca[0], seed=5)]  # A is playing
        second = asyncio.create_task(service.process("A", ta[ca[0].feed : ca[1].feed], None, ca[1]))
        gated.release(3)
        await until(lambda: len(service.step_trace) == STEPS + 3)  # A's second chunk has run 3 of its steps
        first_b = asyncio.create_task(service.process("B", tb[: cb[0].feed], pb, cb[0], seed=6))
        await asyncio.sleep(0.05)  # the worker waits inside A's 4th step meanwhile
        gated.release(1000)
        a.append(await second)
        b = [await first_b]
        joined = next(step for step in service.step_trace if any(rid == "B" for rid, _ in step))
        # B's first step ran together with A's 5th: the step after the one under way when B arrived
        assert dict(joined) == {"A": 4, "B": 0}
        sent_a, sent_b = ca[1].feed, cb[0].feed
        for c in ca[2:]:
            a.append(await service.process("A", ta[sent_a : c.feed], None, c))
            sent_a = c.feed
        for c in cb[1:]:
            b.append(await service.process("B", tb[sent_b : c.feed], None, c))
            sent_b = c.feed
        for got, want in ((a, alone(engine, pa, ta, ca, 5)), (b, alone(engine, pb, tb, cb, 6))):
            assert [x.size for x in got] == [x.size for x in want]
            np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=AUDIO_ATOL)
        assert max(len(step) for step in service.step_trace) == 2  # the chunks really shared steps
        assert service.stats.get("token2wav_steps_total") == len(service.step_trace)
        assert service.stats.get("token2wav_step_rows_total") == sum(len(step) for step in service.step_trace)
        assert service.active_streams() == set() and engine.engine.cache_bytes == 0
    finally:
        gated.release(1000)
        service.shutdown()


async def test_closing_a_stream_mid_flight_frees_its_row_and_caches(chunked_engine):
    engine, schedule = chunked_engine
    prompt = voice(3)
    tokens = np.arange(40, dtype=np.int32) % 89
    chunks = plan(schedule, prompt, 40)
    gated = Gated(engine)
    service = Token2WavService(gated, scheduling="step")
    try:
        gated.release(STEPS)
        await service.process("A", tokens[: chunks[0].feed], prompt, chunks[0], seed=1)
        assert engine.engine.cache_bytes > 0  # A's first chunk is cached
        second = asyncio.create_task(service.process("A", tokens[chunks[0].feed : chunks[1].feed], None, chunks[1]))
        gated.release(2)
        await until(lambda: len(service.step_trace) == STEPS + 2)
        assert service.close_stream("A")
        gated.release(1)  # the step under way finishes; the next iteration drops A's row
        with pytest.raises(InvalidInput, match="closed"):
            await second
        await until(lambda: service.stats.get("token2wav_rows_in_flight") == 0)
        assert engine.engine.cache_bytes == 0
        # the service goes on: a new stream runs a whole utterance
        gated.release(1000)
        audio = await service.process("B", tokens[: chunks[0].feed], prompt, replace(chunks[0], final=True), seed=1)
        assert audio.size > 0
    finally:
        gated.release(1000)
        service.shutdown()


async def test_an_engine_error_fails_only_the_rows_it_hits(chunked_engine):
    engine, schedule = chunked_engine
    good, bad = voice(4), voice(5)
    tokens = np.arange(40, dtype=np.int32) % 83
    chunks = plan(schedule, good, 40)
    original = engine.engine.advance_chunks
    bad_streams: set[int] = set()

    def failing(stepped, batch=None):
        if any(id(c.stream) in bad_streams for c in stepped):
            raise RuntimeError("injected step failure")
        return original(stepped, batch)

    gated = Gated(engine)
    service = Token2WavService(gated, scheduling="step")
    engine.engine.advance_chunks = failing
    try:
        first = [asyncio.create_task(service.process(rid, tokens[: chunks[0].feed], p, chunks[0], seed=2))
                 for rid, p in (("good", good), ("bad", bad))]
        await asyncio.sleep(0.05)
        bad_streams.add(id(service._streams["bad"].stream))
        gated.release(1000)
        ok, failed = await asyncio.gather(*first, return_exceptions=True)
        assert isinstance(failed, RuntimeError) and "injected" in str(failed)
        np.testing.assert_allclose(ok, alone(engine, good, tokens, chunks[:1], 2)[0], atol=AUDIO_ATOL)
        assert service.active_streams() == {"good"}  # the failed stream is gone, the other goes on
        rest = await service.process("good", tokens[chunks[0].feed : chunks[1].feed], None, chunks[1])
        assert rest.size > 0 and service.stats.get("token2wav_failed_total") == 1
    finally:
        engine.engine.advance_chunks = original
        gated.release(1000)
        service.shutdown()


async def test_recomputing_final_chunks_and_offline_jobs_run_as_whole_calls_among_steps(tiny_token2wav):  # noqa: F811
    """flow_cache="exact": non-final chunks are stepped, the final chunk (full attention, recomputed) and an
    offline utterance run as whole calls; every stream still gets its audio alone."""
    engine, schedule = tiny_token2wav
    assert engine.engine.flow_cache == "exact"
    prompts = [voice(7), voice(8, tokens=11)]
    tokens = [np.arange(30, dtype=np.int32) % 71, (np.arange(30, dtype=np.int32) * 3) % 67]
    plans = [plan(schedule, p, 30) for p in prompts]
    service = Token2WavService(engine, scheduling="step")
    try:
        async def stream(rid: str, i: int) -> list[np.ndarray]:
            out, sent = [], 0
            for c in plans[i]:
                out.append(await service.process(rid, tokens[i][sent : c.feed], prompts[i] if c.start == 0 else None,
                                                 c, seed=i))
                sent = c.feed
            return out

        *streams, offline = await asyncio.gather(stream("a", 0), stream("b", 1),
                                                 service.process("x", tokens[0], prompts[1], None, seed=9))
        for i, got in enumerate(streams):
            want = alone(engine, prompts[i], tokens[i], plans[i], i)
            np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=AUDIO_ATOL)
        want_offline = engine.run([Work(engine.open(prompts[1], 9), tokens[0], None)])[0]
        np.testing.assert_allclose(offline, want_offline, atol=AUDIO_ATOL)
        stats = service.stats.snapshot()
        assert stats["token2wav_steps_total"] > 0 and stats["token2wav_call_jobs_total"] >= 3  # 2 finals + offline
    finally:
        service.shutdown()


def test_engines_that_cannot_step_get_whole_calls(tiny_token2wav):  # noqa: F811
    from cosyvoice2_serving.engines import BatchedToken2Wav

    base, schedule = tiny_token2wav
    off = BatchedToken2Wav(base.engine.flow, base.engine.hift, base.engine.config, schedule, "off")
    for engine, expected in ((off, "call"), (base, "step")):
        service = Token2WavService(engine, scheduling="step")
        try:
            assert service.scheduling == expected
        finally:
            service.shutdown()
    with pytest.raises(ValueError, match="scheduling"):
        Token2WavService(base, scheduling="steps")


# -- scheduling policy, on a fake step engine ------------------------------------------------------------
class FakeStepEngine:
    """Every chunk takes `steps` steps; records which streams each admission started (by tokens seen)."""

    def __init__(self, max_rows: int, steps: int = 3, step_s: float = 0.0) -> None:
        self.max_rows, self.steps, self.step_s = max_rows, steps, step_s
        self.admitted: list[list[str]] = []

    def open(self, prompt, seed):
        return {"name": None}

    def steppable(self, item) -> bool:
        return item.chunk is not None

    def run(self, work):
        return [np.asarray(w.tokens, np.float32) for w in work]

    def admit(self, work):
        self.admitted.append([w.state["name"] for w in work])
        return [{"left": self.steps, "audio": np.asarray(w.tokens, np.float32)} for w in work]

    def step(self, handles):
        time.sleep(self.step_s)
        for t in handles:
            t["left"] -= 1
        return [t["audio"] if t["left"] == 0 else None for t in handles]

    def cancel(self, handle) -> None:
        pass


def chunk(start, stop, final=False):
    return Chunk(start=start, stop=stop, feed=stop + (0 if final else 3), final=final)


async def test_first_chunks_are_admitted_before_later_chunks():
    engine = FakeStepEngine(max_rows=1)
    gated = Gated(engine)
    service = Token2WavService(gated, max_defer_s=30.0, scheduling="step")
    try:
        gated.release(3)
        await service.process("playing", np.arange(5), PROMPT, chunk(0, 5))
        service._streams["playing"]["name"] = "playing"
        blocker = asyncio.create_task(service.process("blocker", np.arange(5), PROMPT, chunk(0, 5)))
        await until(lambda: len(engine.admitted) == 2)  # the blocker holds the only row
        later = asyncio.create_task(service.process("playing", np.arange(5, 10), None, chunk(5, 10)))
        await asyncio.sleep(0.01)
        new = asyncio.create_task(service.process("new", np.arange(4), PROMPT, chunk(0, 4)))
        await asyncio.sleep(0.05)
        gated.release(1000)
        await asyncio.gather(blocker, later, new)
        # the blocker's row freed: the new stream's first chunk went before the older later chunk
        assert engine.admitted[2:] == [[None], ["playing"]]
    finally:
        gated.release(1000)
        service.shutdown()


async def test_a_later_chunk_is_not_starved_by_a_flood_of_new_streams():
    engine = FakeStepEngine(max_rows=2, steps=3, step_s=0.002)
    service = Token2WavService(engine, max_defer_s=0.05, scheduling="step")
    try:
        await service.process("playing", np.arange(5), PROMPT, chunk(0, 5))
        flooding = True

        async def flood() -> int:
            n = 0
            while flooding:
                asyncio.create_task(service.process(f"new{n}", np.arange(4), PROMPT, chunk(0, 4, final=True)))
                n += 1
                await asyncio.sleep(0.001)  # arrivals faster than the rows free up
            return n

        flooder = asyncio.create_task(flood())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await asyncio.wait_for(service.process("playing", np.arange(5, 10), None, chunk(5, 10)), timeout=5)
        waited = time.monotonic() - started
        flooding = False
        await flooder
        assert waited < 1.0  # it waited about max_defer_s, then went ahead of the newer first chunks
    finally:
        service.shutdown()


async def test_whole_calls_run_between_steps_and_neither_kind_starves():
    """Offline jobs (whole calls) keep arriving while a stream's chunks are stepped: both make progress."""
    engine = FakeStepEngine(max_rows=4, steps=5, step_s=0.002)
    log: list[str] = []
    run, step = engine.run, engine.step
    engine.run = lambda work: log.append("call") or time.sleep(0.002) or run(work)
    engine.step = lambda handles: log.append("step") or step(handles)
    service = Token2WavService(engine, max_defer_s=0.05, scheduling="step")
    try:
        flooding = True
        answered: list[np.ndarray] = []

        async def offline(n: int) -> None:
            answered.append(await service.process(f"offline{n}", np.arange(3), PROMPT, None))

        async def flood() -> None:
            n = 0
            while flooding:
                asyncio.create_task(offline(n))
                n += 1
                await asyncio.sleep(0.001)

        flooder = asyncio.create_task(flood())
        await asyncio.sleep(0.02)
        stream = [await asyncio.wait_for(service.process("s", np.arange(5), PROMPT, chunk(0, 5)), timeout=5)]
        stream.append(await asyncio.wait_for(service.process("s", np.arange(5, 9), None, chunk(5, 9, True)), 5))
        assert len(answered) > 0  # whole calls were answered while the stream was stepped
        flooding = False
        await flooder
        assert [a.tolist() for a in stream] == [list(range(5)), list(range(5, 9))]
        steps_between_calls = "".join("s" if entry == "step" else "c" for entry in log)
        assert "csc" in steps_between_calls or "cssc" in steps_between_calls  # steps ran between whole calls
    finally:
        service.shutdown()


PROMPT = PromptTensors(np.arange(4, dtype=np.int32), np.zeros((8, 80), np.float32), np.ones(192, np.float32))
