"""ContinuousBatchingScheduler over a scripted slot decoder: joining, finishing, cancelling, overload."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from speech_serving.errors import Overloaded
from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.llm_scheduler import ContinuousBatchingScheduler, StepOutput


@dataclass(frozen=True)
class Script:
    """A request: emit `count` tokens base, base+1, ... then finish (count None: never finish)."""

    base: int
    count: int | None


class ScriptedDecoder:
    """Records the batch of every step, so tests can see which sequences ran together."""

    last_step_sync_seconds = 0.001  # as if each step had waited 1 ms for its tokens
    last_step_device_seconds = 0.0008  # of which its kernels ran 0.8 ms

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: dict[int, list] = {}
        self.batches: list[set[int]] = []
        self.removed: list[int] = []
        self.prefills: list[list[int]] = []  # the request bases of every add_many call
        self.gate = threading.Event()
        self.gate.set()

    def add(self, request: Script) -> int:
        if request.base < 0:
            raise ValueError("bad request")
        slot = min(set(range(self.num_slots)) - set(self.slots))
        self.slots[slot] = [request, 0]
        return slot

    def add_many(self, requests: list[Script]) -> list[int]:
        if any(r.base < 0 for r in requests):  # all or nothing, like the real decoder
            raise ValueError("bad request")
        self.prefills.append([r.base for r in requests])
        return [self.add(r) for r in requests]

    def step(self) -> dict[int, StepOutput]:
        self.gate.wait()
        self.batches.append({state[0].base for state in self.slots.values()})
        out = {}
        for slot, state in self.slots.items():
            request, emitted = state
            state[1] += 1
            done = request.count is not None and state[1] >= request.count
            out[slot] = StepOutput(token=request.base + emitted, finished=done)
        return out

    def remove(self, slot: int) -> None:
        self.removed.append(slot)
        self.slots.pop(slot, None)


async def collect(stream) -> list[int]:
    return [t async for batch in stream for t in batch]



@contextmanager
def scheduling(decoder, **options) -> Iterator[ContinuousBatchingScheduler]:
    """A scheduler over `decoder`, closed (its thread stopped) however the test ends."""
    scheduler = ContinuousBatchingScheduler(decoder, **options)
    try:
        yield scheduler
    finally:
        scheduler.close()


async def test_each_request_gets_its_own_tokens_in_order_and_slots_are_freed():
    decoder = ScriptedDecoder(num_slots=2)
    with scheduling(decoder, max_waiting=8) as scheduler:
        streams = [scheduler.submit(f"r{i}", Script(base=100 * i, count=5 + i)) for i in range(4)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert results == [list(range(100 * i, 100 * i + 5 + i)) for i in range(4)]
        assert max(len(b) for b in decoder.batches) == 2  # never more than the slots
        assert decoder.slots == {} and scheduler.active_request_ids() == set()
        stats = scheduler.stats.snapshot()
        assert stats["llm_finished_total"] == 4 and stats["llm_active_sequences"] == 0
        # step counters are published in bulk, but completely by the time the last sequence has ended
        assert stats["llm_steps_total"] == len(decoder.batches) and stats["llm_step_seconds_total"] > 0
        # each step's wait for its tokens, as the decoder reports it
        assert stats["llm_step_sync_seconds_total"] == pytest.approx(0.001 * len(decoder.batches))
        assert stats["llm_step_device_seconds_total"] == pytest.approx(0.0008 * len(decoder.batches))


async def test_a_new_request_joins_the_running_batch():
    decoder = ScriptedDecoder(num_slots=4)
    with scheduling(decoder, max_waiting=8) as scheduler:
        long = scheduler.submit("long", Script(base=0, count=None))
        it = long.__aiter__()
        await it.__anext__()  # the long sequence is decoding
        short = await collect(scheduler.submit("short", Script(base=1000, count=3)))
        assert short == [1000, 1001, 1002]
        assert {0, 1000} in decoder.batches  # stepped together, not after the long one
        assert scheduler.cancel("long")
        rest = [t async for batch in it for t in batch]
        assert rest == sorted(rest)  # the cancelled stream ends cleanly
        assert scheduler.active_request_ids() == set()
        assert scheduler.stats.get("llm_cancelled_total") == 1


async def test_overload_rejects_beyond_slots_plus_queue_and_bad_requests_fail_alone():
    decoder = ScriptedDecoder(num_slots=1)
    decoder.gate.clear()  # hold every step: nothing finishes
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=1)
    try:
        scheduler.submit("a", Script(0, None))
        scheduler.submit("b", Script(10, None))
        with pytest.raises(Overloaded, match=r"^\[overloaded\]"):
            scheduler.submit("c", Script(20, None))
        with pytest.raises(ValueError, match="duplicate"):
            scheduler.submit("a", Script(0, None))
        scheduler.cancel("a")
        scheduler.cancel("b")
        decoder.gate.set()
        bad = scheduler.submit("bad", Script(-1, 3))
        with pytest.raises(ValueError, match="bad request"):
            await collect(bad)
        assert await collect(scheduler.submit("good", Script(5, 2))) == [5, 6]
    finally:
        decoder.gate.set()
        scheduler.close()


async def test_an_unexpected_worker_error_fails_the_running_requests_but_not_the_scheduler():
    decoder = ScriptedDecoder(num_slots=2)
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=4)
    broken = {"once": True}

    def listener(name, value):
        if name == "llm_steps_total" and value >= 1 and broken.pop("once", False):
            raise RuntimeError("metrics exporter broke")

    scheduler.stats.add_listener(listener)
    try:
        with pytest.raises(RuntimeError, match="metrics exporter broke"):
            await collect(scheduler.submit("a", Script(0, 3)))
        assert await collect(scheduler.submit("b", Script(7, 2))) == [7, 8]
        assert scheduler.active_request_ids() == set()
    finally:
        scheduler.close()


async def test_waiting_requests_are_prefilled_together_and_a_bad_one_still_fails_alone():
    decoder = ScriptedDecoder(num_slots=4)
    decoder.gate.clear()  # hold the first step so that the next three requests wait together
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=8)
    try:
        first = scheduler.submit("first", Script(0, 2))
        while not decoder.slots:
            await asyncio.sleep(0.01)
        together = [scheduler.submit(f"t{i}", Script(100 * (i + 1), 2)) for i in range(3)]
        decoder.gate.set()
        results = await asyncio.gather(collect(first), *(collect(s) for s in together))
        assert results == [[0, 1], [100, 101], [200, 201], [300, 301]]
        assert [100, 200, 300] in decoder.prefills  # one prefill forward for the three that waited
        assert scheduler.stats.get("llm_prefill_calls_total") < 4

        decoder.gate.clear()
        hold = scheduler.submit("hold", Script(7, 1))
        while 7 not in {state[0].base for state in decoder.slots.values()}:
            await asyncio.sleep(0.01)
        bad, good = scheduler.submit("bad", Script(-1, 2)), scheduler.submit("good", Script(50, 2))
        decoder.gate.set()
        with pytest.raises(ValueError, match="bad request"):
            await collect(bad)
        assert await collect(good) == [50, 51] and await collect(hold) == [7]
        assert scheduler.active_request_ids() == set()
    finally:
        decoder.gate.set()
        scheduler.close()


async def deliveries(stream) -> list[tuple[list[int], bool]]:
    return [(d.tokens, d.last) async for d in stream.deliveries()]


async def test_one_wake_up_per_event_loop_and_step_however_many_requests_got_tokens():
    decoder = ScriptedDecoder(num_slots=8)
    decoder.gate.clear()  # all eight join before the first step
    scheduler = ContinuousBatchingScheduler(decoder, max_waiting=8)
    loop = asyncio.get_running_loop()
    wake_ups = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        nonlocal wake_ups
        if threading.current_thread().name == "llm-scheduler":
            wake_ups += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counting
    try:
        streams = [scheduler.submit(f"r{i}", Script(base=100 * i, count=10 + i)) for i in range(8)]
        while len(decoder.slots) < 8:
            await asyncio.sleep(0.01)
        decoder.gate.set()
        results = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        loop.call_soon_threadsafe = original
        decoder.gate.set()
        scheduler.close()
    assert results == [list(range(100 * i, 100 * i + 10 + i)) for i in range(8)]  # every token, in order
    # 8 x ~14 tokens + 8 ends were handed over in at most one wake-up per step
    assert 0 < wake_ups <= len(decoder.batches)


@pytest.mark.parametrize(
    ("count", "deliver_at", "expected"),
    [
        (20, (3, 7, 7, 15), [(range(0, 3), False), (range(3, 7), False), (range(7, 15), False), (range(15, 20), True)]),
        (15, (15, 3), [(range(0, 3), False), (range(3, 15), True)]),  # a boundary at the end: one delivery
        (6, (), [(range(0, 6), True)]),  # no boundary: only the end
        (4, (9, 30), [(range(0, 4), True)]),  # boundaries past the end are never reached
    ],
)
async def test_a_delivery_schedule_hands_over_tokens_only_at_its_boundaries_and_the_end(count, deliver_at, expected):
    decoder = ScriptedDecoder(num_slots=2)
    with scheduling(decoder, max_waiting=4) as scheduler:
        busy = scheduler.submit("busy", Script(base=1000, count=25))  # shares the steps, delivered per token
        scheduled = scheduler.submit("scheduled", Script(base=0, count=count), deliver_at=deliver_at)
        got, other = await asyncio.gather(deliveries(scheduled), collect(busy))
    assert got == [(list(tokens), last) for tokens, last in expected]
    assert other == list(range(1000, 1025))


async def test_a_scheduled_stream_ends_cleanly_on_cancel_and_raises_after_its_tokens_on_failure():
    decoder = ScriptedDecoder(num_slots=2)
    with scheduling(decoder, max_waiting=4) as scheduler:
        stream = scheduler.submit("endless", Script(base=0, count=None), deliver_at=(2, 5))
        it = stream.deliveries().__aiter__()
        first = await it.__anext__()
        assert (first.tokens, first.last) == ([0, 1], False)
        assert scheduler.cancel("endless")
        rest = [(d.tokens, d.last) async for d in it]
        assert rest[-1] == ([], True) and all(tokens == [2, 3, 4] for tokens, _ in rest[:-1])
        assert scheduler.active_request_ids() == set() and decoder.slots == {}

        original_step = decoder.step

        def failing_step():
            out = original_step()
            if len(decoder.batches) == 4:
                raise RuntimeError("device lost")
            return out

        decoder.step = failing_step
        decoder.batches.clear()
        failing = scheduler.submit("failing", Script(base=50, count=None), deliver_at=())
        received = []
        with pytest.raises(RuntimeError, match="device lost"):
            async for tokens in failing:
                received += tokens
        assert received == [50, 51, 52]  # buffered until the end, then handed over before the error
        assert scheduler.stats.get("llm_failed_total") == 1


async def test_the_steps_of_a_stream_are_counted_before_its_end_is_handed_over():
    """Step stats are published every `STEP_STATS_PERIOD_S` while streams run, and at a stream's end, finished or
    cancelled: whoever reads the stats after an end sees every step up to it, though another stream keeps the
    scheduler stepping (thousands of scripted steps a periodic publish would not count yet)."""
    decoder = ScriptedDecoder(num_slots=2)
    with scheduling(decoder, max_waiting=4) as scheduler:
        busy = scheduler.submit("busy", Script(base=1000, count=None), deliver_at=(1,)).deliveries().__aiter__()
        await busy.__anext__()
        for base, ending in enumerate(("cancelled", "finished")):
            script = Script(base=base, count=None if ending == "cancelled" else 3000)
            it = scheduler.submit(ending, script, deliver_at=(1,)).deliveries().__aiter__()
            await it.__anext__()
            await asyncio.sleep(0.02)
            if ending == "cancelled":
                assert scheduler.cancel(ending)
            async for _ in it:
                pass
            counted = scheduler.stats.get("llm_steps_total")
            its_last_step = max(n for n, batch in enumerate(decoder.batches, 1) if base in batch)
            assert counted >= its_last_step, ending
        assert scheduler.cancel("busy")


@contextmanager
def token2wav_call(calls: Token2WavCalls) -> Iterator[None]:
    """A token2wav call running in another thread (as the token2wav worker's) for the body of the block."""
    started, may_end = threading.Event(), threading.Event()

    def run() -> None:
        with calls.running():
            started.set()
            may_end.wait(10)

    worker = threading.Thread(target=run)
    worker.start()
    assert started.wait(5)
    try:
        yield
    finally:
        may_end.set()
        worker.join()


async def steps_while(decoder: ScriptedDecoder, seconds: float) -> int:
    before = len(decoder.batches)
    await asyncio.sleep(seconds)
    return len(decoder.batches) - before


async def test_a_lone_stream_past_its_first_chunk_waits_for_the_running_token2wav_call():
    """`yield_to` (`gpu_yield`, llm_yield=lone): a stream's first chunk is decoded while a token2wav call runs; once
    it is handed over, the lone stream's steps wait for the call, and a request that arrives ends the wait (it is
    prefilled and decoded during the call, the two streams together)."""
    decoder = ScriptedDecoder(num_slots=4)
    calls = Token2WavCalls()
    with scheduling(decoder, max_waiting=8, yield_to=calls, max_yield_s=10.0) as scheduler:
        with token2wav_call(calls):
            deliveries = scheduler.submit("lone", Script(base=0, count=None), deliver_at=(2, 4)).deliveries()
            it = deliveries.__aiter__()
            assert (await it.__anext__()).tokens == [0, 1]  # the first chunk did not wait for the call
            await asyncio.sleep(0.05)  # the step in flight, if any, ends
            assert await steps_while(decoder, 0.2) == 0  # past its first chunk, alone: it waits
            assert await collect(scheduler.submit("other", Script(base=100, count=3))) == [100, 101, 102]
            await asyncio.sleep(0.05)
            assert await steps_while(decoder, 0.2) == 0  # alone again: waiting again
        assert (await it.__anext__()).tokens  # the call ended: the lone stream goes on
        assert await steps_while(decoder, 0.05) > 0
        assert scheduler.stats.get("llm_yield_seconds_total") >= 0.4
        assert scheduler.cancel("lone")


async def test_the_lone_stream_waits_at_most_max_yield_s_and_two_streams_never_wait():
    decoder = ScriptedDecoder(num_slots=4)
    calls = Token2WavCalls()
    with scheduling(decoder, max_waiting=8, yield_to=calls, max_yield_s=0.01) as scheduler:
        lone = scheduler.submit("lone", Script(base=0, count=None), deliver_at=(1,)).deliveries().__aiter__()
        await lone.__anext__()
        with token2wav_call(calls):
            assert await steps_while(decoder, 0.2) > 0  # a wait ends after 10 ms: steps go on
    decoder = ScriptedDecoder(num_slots=4)
    with scheduling(decoder, max_waiting=8, yield_to=calls, max_yield_s=10.0) as scheduler:
        streams = [scheduler.submit(name, Script(base=base, count=None), deliver_at=(1,)).deliveries().__aiter__()
                   for name, base in (("a", 0), ("b", 100))]
        for stream in streams:
            await stream.__anext__()
        with token2wav_call(calls):
            assert await steps_while(decoder, 0.1) > 0  # two streams: the LLM does not wait
        assert scheduler.stats.get("llm_yield_seconds_total") == 0


@pytest.mark.parametrize("mode", ["always", "first_chunks"])
def test_an_unknown_yield_mode_is_refused(mode):
    with pytest.raises(ValueError, match="yield_mode"):
        ContinuousBatchingScheduler(ScriptedDecoder(num_slots=1), max_waiting=0, yield_mode=mode)
