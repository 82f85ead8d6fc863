"""Token2WavService (fake engine): stream lifetime, ordering, batching, close; BatchedToken2Wav (tiny model):
batched flow gives the same audio as one stream at a time."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import numpy as np
import pytest

from cosyvoice2.streaming import Chunk
from speech_serving.errors import InvalidInput
from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.io_struct import PromptTensors
from speech_serving.token2wav import Token2WavService, Work

PROMPT = PromptTensors(np.arange(4, dtype=np.int32), np.zeros((8, 80), np.float32), np.ones(192, np.float32))


class FakeEngine:
    """State = list of tokens seen; audio = the tokens as floats. Can hold calls and fail on demand."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = 0  # calls that reached run(), held by the gate or not

    def open(self, prompt, seed):
        return {"tokens": [], "id": None}

    def run(self, work):
        self.entered += 1
        self.gate.wait()
        self.calls.append([len(w.state["tokens"]) for w in work])
        out = []
        for w in work:
            if (w.tokens < 0).any():
                out.append(RuntimeError("bad token"))
                continue
            w.state["tokens"].extend(w.tokens.tolist())
            out.append(np.asarray(w.tokens, np.float32))
        return out


def chunk(start, stop, final=False):
    return Chunk(start=start, stop=stop, feed=stop + (0 if final else 3), final=final)


async def test_stream_lives_from_first_chunk_to_final_and_chunks_of_streams_share_calls():
    engine = FakeEngine()
    service = Token2WavService(engine)
    try:
        engine.gate.clear()
        first = [asyncio.create_task(service.process(f"s{i}", np.arange(8), PROMPT, chunk(0, 5), seed=1)) for i in range(3)]
        await asyncio.sleep(0.05)
        engine.gate.set()
        assert all(r.tolist() == list(range(8)) for r in await asyncio.gather(*first))
        assert service.active_streams() == {"s0", "s1", "s2"}
        assert max(len(c) for c in engine.calls) >= 2  # concurrent chunks went to the engine together
        for i in range(3):
            await service.process(f"s{i}", np.arange(8, 10), None, chunk(5, 10, final=True))
        assert service.active_streams() == set()
        assert service.stats.get("token2wav_active_streams") == 0
    finally:
        service.shutdown()


async def test_close_frees_the_stream_and_a_late_first_chunk_cannot_reopen_it():
    service = Token2WavService(FakeEngine())
    try:
        await service.process("s", np.arange(8), PROMPT, chunk(0, 5))
        assert service.close_stream("s") and service.active_streams() == set()
        with pytest.raises(InvalidInput, match="closed"):
            await service.process("s", np.arange(8, 10), None, chunk(5, 10, final=True))
        assert service.close_stream("late") is False  # a close that overtakes the first chunk...
        with pytest.raises(InvalidInput, match="closed"):
            await service.process("late", np.arange(8), PROMPT, chunk(0, 5))  # ...keeps it from opening
        assert service.active_streams() == set()
    finally:
        service.shutdown()


async def test_idle_streams_of_a_vanished_orchestrator_expire():
    service = Token2WavService(FakeEngine(), idle_timeout_s=0.05)
    try:
        await service.process("orphan", np.arange(8), PROMPT, chunk(0, 5))
        assert service.active_streams() == {"orphan"}
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not service.active_streams():
                break
        assert service.active_streams() == set() and service.stats.get("token2wav_expired_total") == 1
        with pytest.raises(InvalidInput, match="expired"):
            await service.process("orphan", np.arange(8, 10), None, chunk(5, 10, final=True))
    finally:
        service.shutdown()


async def test_errors_free_the_stream_and_do_not_touch_other_streams():
    service = Token2WavService(FakeEngine())
    try:
        await service.process("ok", np.arange(8), PROMPT, chunk(0, 5))
        await service.process("bad", np.arange(8), PROMPT, chunk(0, 5))
        with pytest.raises(RuntimeError, match="bad token"):
            await service.process("bad", np.array([-1, 2]), None, chunk(5, 10))
        with pytest.raises(InvalidInput, match="not open"):
            await service.process("never", np.arange(3), None, chunk(0, 5))
        with pytest.raises(InvalidInput, match="already open"):
            await service.process("ok", np.arange(3), PROMPT, chunk(0, 5))
        assert service.active_streams() == {"ok"}
        offline = await service.process("x", np.arange(5), PROMPT, None)
        assert offline.tolist() == list(range(5)) and service.active_streams() == {"ok"}
    finally:
        service.shutdown()


# -- the real engine adapter on the tiny model -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_token2wav(tmp_path_factory):
    import torch

    from cosyvoice2.config import EngineConfig
    from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, load_flow, load_hift
    from cosyvoice2.testing import write_tiny_model
    from speech_serving.engines import BatchedToken2Wav
    from speech_serving.schedule import StreamScheduleParams

    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    config = EngineConfig.for_model_dir(model_dir)
    flow = load_flow(model_dir / FLOW_FILE, config, torch.device("cpu"), torch.float32)
    hift = load_hift(model_dir / HIFT_FILE, config, torch.device("cpu"))
    schedule = StreamScheduleParams(first_hop=5, chunk_growth=2).schedule(config)
    return BatchedToken2Wav(flow, hift, config, schedule), schedule


def test_batched_flow_gives_the_same_audio_as_one_stream_at_a_time(tiny_token2wav):
    engine, schedule = tiny_token2wav
    rng = np.random.default_rng(0)
    prompt = PromptTensors(
        rng.integers(0, 100, 6).astype(np.int32), rng.standard_normal((12, 80)).astype(np.float32),
        rng.standard_normal(192).astype(np.float32),
    )  # fmt: skip
    tokens = [rng.integers(0, 100, 80).astype(np.int32) for _ in range(3)]
    plan = replace(schedule, prompt_tokens=6).chunks(80)
    assert len(plan) >= 3

    def run(batched: bool) -> list[list[np.ndarray]]:
        states = [engine.open(prompt, seed=11) for _ in tokens]
        outputs: list[list[np.ndarray]] = [[] for _ in tokens]
        sent = 0
        for c in plan:
            new = [t[sent : c.feed] for t in tokens]
            work = [Work(state, part, c) for state, part in zip(states, new)]
            results = engine.run(work) if batched else [engine.run([w])[0] for w in work]
            for out, result in zip(outputs, results):
                assert not isinstance(result, Exception), result
                out.append(result)
            sent = c.feed
        return outputs

    one_by_one, together = run(batched=False), run(batched=True)
    for a, b in zip(one_by_one, together):
        a, b = np.concatenate(a), np.concatenate(b)
        # equal up to batched-matmul rounding through 10 Euler steps and the vocoder
        np.testing.assert_allclose(a, b, atol=5e-4)
        assert np.corrcoef(a, b)[0, 1] > 0.999
    assert sum(x.size for x in together[0]) == 80 * 960
    offline = engine.run([Work(engine.open(prompt, 11), tokens[0], None), Work(engine.open(prompt, 11), tokens[1], None)])
    single = engine.run([Work(engine.open(prompt, 11), tokens[0], None)])[0]
    np.testing.assert_allclose(offline[0], single, atol=5e-4)
    assert offline[0].size == 80 * 960


class TimedEngine(FakeEngine):
    """FakeEngine whose audio plays at `sample_rate` (one sample per token) and whose calls hold `max_rows` jobs."""

    def __init__(self, sample_rate: int, max_rows: int) -> None:
        super().__init__()
        self.sample_rate, self.max_rows = sample_rate, max_rows


async def hold_the_worker(service, engine) -> asyncio.Task:
    """A first chunk whose call the worker holds (the gate is closed) until the test opens the gate."""
    engine.gate.clear()
    entered = engine.entered
    blocker = asyncio.create_task(service.process("blocker", np.arange(3), PROMPT, chunk(0, 3)))
    # the worker thread must hold the blocker's call before the others queue (a fixed sleep is not enough when a
    # loaded machine schedules that thread late: it would batch them with the blocker)
    for _ in range(3000):
        if engine.entered > entered:
            return blocker
        await asyncio.sleep(0.01)
    raise AssertionError("the worker never started the blocker's call")


async def test_a_new_streams_first_chunk_goes_into_the_next_call_ahead_of_more_later_chunks_than_fit():
    engine = TimedEngine(sample_rate=1, max_rows=2)  # every answered token is a second of buffered audio
    service = Token2WavService(engine)
    try:
        playing = [f"p{i}" for i in range(3)]
        for i, stream in enumerate(playing):  # mid-utterance, with different amounts of audio buffered
            await service.process(stream, np.arange(10 + 10 * i), PROMPT, chunk(0, 5))
        blocker = await hold_the_worker(service, engine)
        engine.calls.clear()
        later = [asyncio.create_task(service.process(s, np.arange(5), None, chunk(5, 10))) for s in playing]
        await asyncio.sleep(0.02)
        first = asyncio.create_task(service.process("new", np.arange(4), PROMPT, chunk(0, 4)))  # arrives last
        await asyncio.sleep(0.05)
        engine.gate.set()
        await asyncio.gather(blocker, first, *later)
        # calls list the tokens each stream had seen: a new stream 0, p0/p1/p2 10/20/30 (buffered 10/20/30 s);
        # the first chunk runs alone (later chunks with audio to spare would only slow its call), then the rest
        # by deadline, two per call
        assert engine.calls[1:] == [[0], [10, 20], [30]], engine.calls
        assert service.stats.get("token2wav_capped_calls_total") == 1
    finally:
        service.shutdown()


async def test_a_stream_about_to_run_dry_goes_before_a_first_chunk():
    engine = TimedEngine(sample_rate=10, max_rows=2)
    service = Token2WavService(engine)
    try:
        await service.process("dry", np.arange(1), PROMPT, chunk(0, 5))  # 0.1 s of audio
        await service.process("rich", np.arange(1000), PROMPT, chunk(0, 5))  # 100 s of audio
        blocker = await hold_the_worker(service, engine)
        engine.calls.clear()
        later = [asyncio.create_task(service.process(s, np.arange(5), None, chunk(5, 10))) for s in ("rich", "dry")]
        await asyncio.sleep(0.02)
        first = asyncio.create_task(service.process("new", np.arange(4), PROMPT, chunk(0, 4)))
        await asyncio.sleep(0.2)  # "dry" has played all it had
        engine.gate.set()
        await asyncio.gather(blocker, first, *later)
        assert engine.calls[1:] == [[1, 0], [1000]], engine.calls  # dry, then the new stream; rich waits
        assert service.stats.get("token2wav_starving_jobs_total") == 1
    finally:
        service.shutdown()


async def test_a_call_never_holds_more_jobs_than_the_row_cap():
    engine = TimedEngine(sample_rate=24000, max_rows=3)
    service = Token2WavService(engine)
    try:
        blocker = await hold_the_worker(service, engine)
        first = [asyncio.create_task(service.process(f"s{i}", np.arange(8), PROMPT, chunk(0, 5))) for i in range(7)]
        offline = [asyncio.create_task(service.process(f"o{i}", np.arange(4), PROMPT, None)) for i in range(2)]
        await asyncio.sleep(0.05)
        engine.gate.set()
        await asyncio.gather(blocker, *first, *offline)
        later = [service.process(f"s{i}", np.arange(8, 12), None, chunk(5, 10, final=True)) for i in range(7)]
        await asyncio.gather(*later)
        assert sum(map(len, engine.calls)) == 1 + 7 + 2 + 7  # every job ran once
        assert max(map(len, engine.calls)) == 3 and service.stats.get("token2wav_max_jobs_per_call") == 3
        assert service.active_streams() == {"blocker"}  # the others ended with their final chunks
    finally:
        service.shutdown()


async def test_the_service_times_its_calls_against_their_rows():
    """The service tells `CallTimes` each call's rows and seconds, and asks it for a call of as many jobs as are
    pending (up to the row cap), not for one row."""
    engine = TimedEngine(sample_rate=24000, max_rows=4)
    service = Token2WavService(engine)
    observed: list[tuple[int, float]] = []
    asked: list[int] = []
    times = service.call_times
    observe, expected = times.observe, times.expected
    times.observe = lambda rows, seconds: (observed.append((rows, seconds)), observe(rows, seconds))[1]
    times.expected = lambda rows: (asked.append(rows), expected(rows))[1]
    try:
        blocker = await hold_the_worker(service, engine)
        streams = [asyncio.create_task(service.process(f"s{i}", np.arange(8), PROMPT, chunk(0, 5))) for i in range(6)]
        await asyncio.sleep(0.05)
        engine.gate.set()
        await asyncio.gather(blocker, *streams)
        service.shutdown()  # the worker observes a call after answering its jobs: wait for it to finish
        assert sorted(map(len, engine.calls)) == [1, 2, 4]
        assert sorted(rows for rows, _ in observed) == [1, 2, 4] and all(seconds > 0 for _, seconds in observed)
        assert observed[0][1] >= 0.05  # the blocker's call, held by the gate for the test's sleep
        assert 4 in asked  # six jobs pending behind the blocker: a call of the cap's rows, what the policy weighs
    finally:
        service.shutdown()


def test_the_row_cap_is_the_engines_unless_given():
    engine = TimedEngine(sample_rate=24000, max_rows=4)
    for service, cap in ((Token2WavService(engine), 4), (Token2WavService(engine, max_rows=2), 2),
                         (Token2WavService(FakeEngine()), None)):
        try:
            assert service.policy.max_rows == cap
        finally:
            service.shutdown()


class CountingEngine(FakeEngine):
    """Counts flow frame-rows as an engine with graph buckets does: 4 needed and 8 computed per job (2 of them in
    padding rows), attention's query x key frames 12 needed and 20 computed per job; one refused cache growth and two
    allocator retries per call."""

    def __init__(self) -> None:
        super().__init__()
        self.needed = self.computed = self.refused = self.retries = 0

    def run(self, work):
        self.needed += 4 * len(work)
        self.computed += 8 * len(work)
        self.refused += 1
        self.retries += 2
        return super().run(work)

    def allocator_retries(self):
        return (self.retries,)

    def frame_counts(self):
        return self.needed, self.computed

    def flow_cache_refusals(self):
        return (self.refused,)


async def test_the_flow_padding_of_each_call_is_published():
    engine = CountingEngine()
    service = Token2WavService(engine)
    try:
        await asyncio.gather(*(service.process(f"s{i}", np.arange(8), PROMPT, None) for i in range(3)))
        await service.process("t", np.arange(8), PROMPT, None)
        assert service.stats.get("token2wav_flow_frames_needed_total") == 4 * 4
        assert service.stats.get("token2wav_flow_frames_computed_total") == 8 * 4
        calls = service.stats.get("token2wav_engine_calls_total")
        assert calls >= 2 and service.stats.get("token2wav_flow_cache_refused_total") == calls
        assert service.stats.get("token2wav_cuda_alloc_retries_total") == 2 * calls
    finally:
        service.shutdown()


async def test_each_engine_call_is_marked_running_for_the_llm_of_the_process():
    """`calls` (`gpu_yield`): the LLM scheduler sees a call running exactly while the engine runs one."""
    engine = FakeEngine()
    calls = Token2WavCalls()
    seen = []
    run = engine.run
    engine.run = lambda work: seen.append(calls.busy) or run(work)
    service = Token2WavService(engine, calls=calls)
    try:
        await service.process("s", np.arange(8), PROMPT, chunk(0, 5), seed=1)
        await service.process("s", np.arange(8, 12), None, chunk(5, 9))
        # running inside each call, not after it
        assert seen == [True, True] and not calls.busy and calls.started == 2
    finally:
        service.shutdown()
