"""The first-chunk counters of each serving layer (docs/PERFORMANCE.md#what-is-measured), with fake engines and
clients whose delays the tests choose: what counts as a first chunk, what does not (later chunks, offline,
cancelled, failed), and that every stage is measured where it happens (each at least the delay the test put there,
and all of them together no more than what the caller saw)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from cosyvoice2.streaming import Chunk
from speech_serving import llm_scheduler, orchestrator as orchestrator_module, token2wav
from speech_serving.stats import Stats
from speech_serving.token2wav import Token2WavService
from tests.serving.test_llm_scheduler import Script, ScriptedDecoder, scheduling
from tests.serving.test_orchestrator import FakeClients, orchestrator, request
from tests.serving.test_token2wav_service import PROMPT, FakeEngine

HOLD_S = 0.15  # how long a test keeps a resource busy; the measured waits must be at least this


def first_chunk_stats(stats: Stats, names: tuple[str, ...]) -> dict[str, float]:
    """The layer's first-chunk counters by their stage (the name without prefix and `_seconds_total`)."""
    values = stats.snapshot()
    out = {"count": values[names[0]]}
    for name in names[1:]:
        out[name.split("_first_chunk_")[1].removesuffix("_total").removesuffix("_seconds")] = values[name]
    return out


def test_stats_add_all_changes_every_value_at_once_and_rejects_unknown_names():
    stats, seen = Stats(("a_total", "b_total")), []
    stats.add_listener(lambda name, value: seen.append((name, value)))
    stats.add_all({"a_total": 1, "b_total": 0.5})
    stats.add_all({"a_total": 1, "b_total": 0.25})
    assert stats.snapshot() == {"a_total": 2, "b_total": 0.75}
    assert seen[-2:] == [("a_total", 2), ("b_total", 0.75)]
    with pytest.raises(KeyError):
        stats.add_all({"a_total": 1, "typo_total": 1})
    assert stats.snapshot() == {"a_total": 2, "b_total": 0.75}  # all or nothing


def test_every_layer_exports_its_first_chunk_counters_as_counters():
    for names, exported in ((llm_scheduler.FIRST_CHUNK_STATS, llm_scheduler.LLM_STATS),
                            (token2wav.FIRST_CHUNK_STATS, token2wav.TOKEN2WAV_STATS),
                            (orchestrator_module.FIRST_CHUNK_STATS, orchestrator_module.ORCHESTRATOR_STATS)):
        assert set(names) <= set(exported) and len(set(exported)) == len(exported)
        assert all(name.endswith("_total") for name in names)  # MetricsExporter: sums that only grow
        assert names[0].endswith("_first_chunks_total")  # one count per layer, first


# -- the LLM scheduler ----------------------------------------------------------------------------------------------
class SlowDecoder(ScriptedDecoder):
    """A scripted decoder whose prefills take `prefill_s` and whose steps take `step_s`."""

    def __init__(self, num_slots: int, prefill_s: float = 0.0, step_s: float = 0.0) -> None:
        super().__init__(num_slots)
        self.prefill_s, self.step_s = prefill_s, step_s

    def add(self, request):
        time.sleep(self.prefill_s)
        return super().add(request)

    def add_many(self, requests):
        time.sleep(self.prefill_s)
        return super().add_many(requests)

    def step(self):
        time.sleep(self.step_s)
        return super().step()


def llm_stats(scheduler) -> dict[str, float]:
    return first_chunk_stats(scheduler.stats, llm_scheduler.FIRST_CHUNK_STATS)


async def drain(stream) -> list[int]:
    return [token async for batch in stream for token in batch]


async def test_llm_counts_a_streaming_request_once_at_its_first_boundary():
    decoder = SlowDecoder(num_slots=2, prefill_s=0.03, step_s=0.005)
    with scheduling(decoder, max_waiting=4) as scheduler:
        started = time.monotonic()
        stream = scheduler.submit("r", Script(base=0, count=12), deliver_at=(5, 8, 11))
        deliveries = stream.deliveries()
        first = await deliveries.__anext__()
        seen = time.monotonic() - started
        assert first.tokens == [0, 1, 2, 3, 4]
        async for _ in deliveries:  # the later boundaries and the end
            pass
        stats = llm_stats(scheduler)
        assert stats["count"] == 1  # the later chunks are not first chunks
        assert stats["steps"] == 5  # one step per token up to the first boundary
        assert stats["prefill"] >= decoder.prefill_s
        assert stats["decode"] >= 5 * decoder.step_s
        assert stats["wait"] >= 0 and stats["wait"] + stats["prefill"] + stats["decode"] <= seen


async def test_llm_counts_the_queue_wait_of_a_request_admitted_later():
    decoder = SlowDecoder(num_slots=1)
    with scheduling(decoder, max_waiting=4) as scheduler:
        decoder.gate.clear()
        holder = scheduler.submit("holder", Script(base=0, count=3), deliver_at=(1,))
        queued = scheduler.submit("queued", Script(base=100, count=3), deliver_at=(1,))
        await asyncio.sleep(HOLD_S)  # the holder's first step is stuck: the queued request waits for the slot
        decoder.gate.set()
        assert await drain(holder) == [0, 1, 2] and await drain(queued) == [100, 101, 102]
        stats = llm_stats(scheduler)
        assert stats["count"] == 2 and stats["steps"] == 2
        assert stats["wait"] >= HOLD_S  # the queued one's (the holder was admitted at once)


async def test_llm_counts_a_request_that_ends_before_its_first_boundary_at_its_end():
    with scheduling(SlowDecoder(num_slots=1), max_waiting=4) as scheduler:
        assert await drain(scheduler.submit("short", Script(base=0, count=3), deliver_at=(10,))) == [0, 1, 2]
        stats = llm_stats(scheduler)
        assert stats["count"] == 1 and stats["steps"] == 3
        # a streaming request too short for any boundary: its end is its first chunk too
        shorter = scheduler.submit("shorter", Script(base=0, count=2), deliver_at=(), streaming=True)
        assert await drain(shorter) == [0, 1]
        stats = llm_stats(scheduler)
        assert stats["count"] == 2 and stats["steps"] == 3 + 2


async def test_llm_without_a_schedule_counts_the_first_token_and_offline_requests_not_at_all():
    with scheduling(SlowDecoder(num_slots=2), max_waiting=4) as scheduler:
        assert await drain(scheduler.submit("offline", Script(base=0, count=4), deliver_at=())) == [0, 1, 2, 3]
        assert await drain(scheduler.submit("told", Script(base=0, count=4), (2,), streaming=False)) == [0, 1, 2, 3]
        assert llm_stats(scheduler)["count"] == 0  # offline: no first chunk
        assert await drain(scheduler.submit("tokens", Script(base=0, count=4))) == [0, 1, 2, 3]
        stats = llm_stats(scheduler)
        assert stats["count"] == 1 and stats["steps"] == 1


async def test_llm_does_not_count_cancelled_or_failed_requests():
    decoder = SlowDecoder(num_slots=1)
    with scheduling(decoder, max_waiting=4) as scheduler:
        running = scheduler.submit("running", Script(base=0, count=None), deliver_at=(10_000,))
        waiting = scheduler.submit("waiting", Script(base=0, count=None), deliver_at=(1,))
        await asyncio.sleep(0.05)
        running.cancel()
        waiting.cancel()
        assert await drain(running) == [] and await drain(waiting) == []
        with pytest.raises(ValueError, match="bad request"):  # fails in its prefill
            await drain(scheduler.submit("bad", Script(base=-1, count=3), deliver_at=(1,)))
        decoder.step = lambda: (_ for _ in ()).throw(RuntimeError("step failed"))
        with pytest.raises(RuntimeError, match="step failed"):  # admitted, then fails in a step
            await drain(scheduler.submit("broken", Script(base=0, count=3), deliver_at=(1,)))
        stats = scheduler.stats.snapshot()
        assert stats["llm_cancelled_total"] == 2 and stats["llm_failed_total"] == 2
        assert llm_stats(scheduler) == dict.fromkeys(["count", "wait", "prefill", "decode", "steps"], 0.0)


# -- the token2wav service ---------------------------------------------------------------------------------------
class SlowEngine(FakeEngine):
    """The service's fake engine; every call takes at least `call_s`."""

    def __init__(self, call_s: float = 0.0) -> None:
        super().__init__()
        self.call_s = call_s

    def run(self, work):
        time.sleep(self.call_s)
        return super().run(work)


def chunk(start, stop, final=False):
    return Chunk(start=start, stop=stop, feed=stop + (0 if final else 3), final=final)


def t2w_stats(service) -> dict[str, float]:
    return first_chunk_stats(service.stats, token2wav.FIRST_CHUNK_STATS)


async def test_token2wav_counts_a_queued_first_chunks_wait_and_its_calls_rows():
    engine = SlowEngine(call_s=0.02)
    service = Token2WavService(engine)
    try:
        engine.gate.clear()
        started = time.monotonic()
        holder = asyncio.create_task(service.process("holder", np.arange(8), PROMPT, chunk(0, 5)))
        while engine.entered < 1:  # the holder's call is running (held)
            await asyncio.sleep(0.005)
        queued = [asyncio.create_task(service.process(f"q{i}", np.arange(8), PROMPT, chunk(0, 5))) for i in range(2)]
        await asyncio.sleep(HOLD_S)
        engine.gate.set()
        await asyncio.gather(holder, *queued)
        seen = time.monotonic() - started
        assert [len(call) for call in engine.calls] == [1, 2]  # the two queued first chunks shared the next call
        stats = t2w_stats(service)
        assert stats["count"] == 3
        assert stats["rows"] == 1 + 2 + 2  # per first chunk, the rows of its call
        # each queued one waited for the held call: about HOLD_S from its arrival, which comes a little after the
        # task was created (the clocks differ by the task's start-up)
        assert stats["wait"] >= 2 * 0.9 * HOLD_S
        assert stats["call"] >= 3 * engine.call_s
        assert stats["wait"] + stats["call"] <= 3 * seen
        # later chunks and offline jobs are no first chunks
        await service.process("holder", np.arange(8, 12), None, chunk(5, 10, final=True))
        await service.process("offline", np.arange(5), PROMPT, None)
        assert t2w_stats(service)["count"] == 3
    finally:
        service.shutdown()


async def test_token2wav_counts_a_one_chunk_stream_and_not_failed_or_closed_first_chunks():
    service = Token2WavService(SlowEngine())
    try:
        await service.process("whole", np.arange(6), PROMPT, chunk(0, 6, final=True))  # its first chunk is final
        assert t2w_stats(service)["count"] == 1
        with pytest.raises(RuntimeError, match="bad token"):
            await service.process("bad", np.array([-1, 2]), PROMPT, chunk(0, 5))
        service.close_stream("closed")
        with pytest.raises(Exception, match="closed"):
            await service.process("closed", np.arange(8), PROMPT, chunk(0, 5))
        assert t2w_stats(service)["count"] == 1 and service.stats.get("token2wav_failed_total") == 1
    finally:
        service.shutdown()


# -- the orchestrator ------------------------------------------------------------------------------------------------
class TimedClients(FakeClients):
    """FakeClients whose voice prompt, first LLM response and token2wav calls take the given seconds."""

    def __init__(self, tokens, prompt_s: float, llm_s: float, token2wav_s: float, **kwargs) -> None:
        super().__init__(tokens, **kwargs)
        self.prompt_s, self.llm_s, self.token2wav_s = prompt_s, llm_s, token2wav_s

    async def voice_prompt(self, request):
        await asyncio.sleep(self.prompt_s)
        return await super().voice_prompt(request)

    async def llm(self, request_id, request):
        await asyncio.sleep(self.llm_s)
        async for ids in super().llm(request_id, request):
            yield ids

    async def token2wav(self, request_id, tokens, prompt, chunk, seed):
        await asyncio.sleep(self.token2wav_s)
        return await super().token2wav(request_id, tokens, prompt, chunk, seed)


def orchestrator_stats(orch) -> dict[str, float]:
    return first_chunk_stats(orch.stats, orchestrator_module.FIRST_CHUNK_STATS)


async def test_orchestrator_lays_a_streaming_requests_way_to_its_first_response_end_to_end():
    clients = TimedClients(list(range(45)), prompt_s=0.03, llm_s=0.05, token2wav_s=0.04, batch=2)
    orch = orchestrator(clients)
    started = time.monotonic()
    chunks = orch.synthesize(request(), streaming=True)
    await chunks.__anext__()
    await asyncio.sleep(HOLD_S)  # the consumer takes its time before asking for more: the send stage
    await chunks.__anext__()
    seen = time.monotonic() - started
    assert orchestrator_stats(orch)["count"] == 1
    rest = [c async for c in chunks]
    assert rest and rest[-1].final
    stats = orchestrator_stats(orch)
    assert stats["count"] == 1  # the later chunks are not counted
    assert stats["prompt"] >= clients.prompt_s
    assert stats["tokens"] >= clients.llm_s  # the first chunk's tokens came after the LLM's delay
    assert stats["audio"] >= clients.token2wav_s
    assert stats["send"] >= HOLD_S
    assert sum(stats[stage] for stage in ("prompt", "tokens", "audio", "send")) <= seen


async def test_orchestrator_counts_a_one_chunk_stream_but_not_offline_cancelled_or_warm_up_requests():
    orch = orchestrator(FakeClients(list(range(4))))  # fewer tokens than the first hop: one final chunk
    [only] = [c async for c in orch.synthesize(request(), streaming=True)]
    assert only.final and orchestrator_stats(orch)["count"] == 1
    [c async for c in orch.synthesize(request(), streaming=False)]
    [c async for c in orch.synthesize(request(text=""), streaming=True)]  # the voice only: no audio
    held = orchestrator(FakeClients(list(range(45)), batch=2, hold_after=4))  # the LLM stops before the first chunk
    task = asyncio.create_task(held.synthesize(request(), streaming=True).__anext__())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert orchestrator_stats(orch)["count"] == 1 and orchestrator_stats(held)["count"] == 0
    assert held.stats.get("orchestrator_cancelled_total") == 1


def test_first_chunk_times_counts_only_a_complete_way_once():
    stats = Stats(orchestrator_module.ORCHESTRATOR_STATS)
    times = orchestrator_module.FirstChunkTimes(stats)
    for _ in range(5):  # marks beyond the three stages are ignored
        times.mark()
    times.sent()
    times.sent()  # a second response is not a first one
    incomplete = orchestrator_module.FirstChunkTimes(stats)
    incomplete.mark()
    incomplete.sent()
    orchestrator_module.FirstChunkTimes(stats, streaming=False).sent()
    assert stats.get("orchestrator_first_chunks_total") == 1

