"""The LLM steps that ran beside a token2wav call of the same process (`BESIDE_TOKEN2WAV_STATS`): which steps count,
their seconds and GPU waits, and that the counters exist only where the scheduler sees token2wav's calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import pytest

from speech_serving.gpu_yield import Token2WavCalls
from speech_serving.llm_scheduler import BESIDE_TOKEN2WAV_STATS, LLM_STATS
from speech_serving.stats import Stats
from speech_serving.token2wav import Token2WavService
from tests.serving.test_llm_scheduler import Script, ScriptedDecoder, collect, scheduling, steps_while, token2wav_call
from tests.serving.test_token2wav_service import PROMPT, FakeEngine, chunk

BESIDE_S = 0.01  # how long each step that runs beside a call sleeps: its counted seconds are at least this


class HookedDecoder(ScriptedDecoder):
    """Runs `during[n]` inside its n-th step (from 1), and reports a GPU wait of 2**n ms for it: a sum of the waits
    names exactly the steps it adds up."""

    def __init__(self, num_slots: int, during: dict[int, Callable[[], None]]) -> None:
        super().__init__(num_slots)
        self.during = during
        self.last_step_sync_seconds = 0.0

    def step(self):
        out = super().step()
        n = len(self.batches)
        self.last_step_sync_seconds = 2.0**n / 1000
        if n in self.during:
            self.during[n]()
        return out


def sync_of(*steps: int) -> float:
    return sum(2.0**n / 1000 for n in steps)


class CallInSteps:
    """A token2wav call marked from inside the decoder's steps: entered in one step, left in a later one."""

    def __init__(self, calls: Token2WavCalls) -> None:
        self.calls = calls
        self._call: AbstractContextManager[None] | None = None

    def start(self) -> None:
        time.sleep(BESIDE_S)
        self._call = self.calls.running()
        self._call.__enter__()

    def keep(self) -> None:
        time.sleep(BESIDE_S)

    def end(self) -> None:
        time.sleep(BESIDE_S)
        assert self._call is not None
        self._call.__exit__(None, None, None)

    def start_and_end(self) -> None:
        time.sleep(BESIDE_S)
        with self.calls.running():
            pass


@pytest.mark.parametrize("wired", ["yield_to", "observe_token2wav"])
async def test_a_step_counts_beside_when_a_call_runs_at_its_start_or_starts_in_it(wired):
    """Steps 1-6 of one offline request (it never waits for a call: `gpu_yield` waits only for a streaming one):
    2: a call starts and ends inside it; 3: a call starts in it; 4: that call runs throughout; 5: it ends in it;
    1 and 6: no call. Steps 2-5 are beside token2wav, 1 and 6 not."""
    calls = Token2WavCalls()
    call = CallInSteps(calls)
    decoder = HookedDecoder(1, {2: call.start_and_end, 3: call.start, 4: call.keep, 5: call.end})
    options = {"yield_to": calls} if wired == "yield_to" else {}
    with scheduling(decoder, max_waiting=1, **options) as scheduler:
        if wired == "observe_token2wav":
            scheduler.observe_token2wav(calls)
        tokens = await collect(scheduler.submit("r", Script(base=0, count=6), deliver_at=(), streaming=False))
        assert tokens == list(range(6))
        stats = scheduler.stats.snapshot()
    assert stats["llm_steps_total"] == 6
    assert stats["llm_steps_beside_token2wav_total"] == 4
    assert stats["llm_step_beside_token2wav_sync_seconds_total"] == pytest.approx(sync_of(2, 3, 4, 5))
    assert stats["llm_step_sync_seconds_total"] == pytest.approx(sync_of(1, 2, 3, 4, 5, 6))
    beside_s = stats["llm_step_beside_token2wav_seconds_total"]
    assert 4 * BESIDE_S <= beside_s <= stats["llm_step_seconds_total"]
    assert stats["llm_yield_seconds_total"] == 0


async def test_steps_without_a_call_are_not_beside_and_the_counters_are_there_at_zero():
    calls = Token2WavCalls()
    decoder = HookedDecoder(1, {})
    with scheduling(decoder, max_waiting=1) as scheduler:
        scheduler.observe_token2wav(calls)
        assert await collect(scheduler.submit("r", Script(base=0, count=5))) == list(range(5))
        stats = scheduler.stats.snapshot()
    assert stats["llm_steps_total"] == 5
    assert {name: stats[name] for name in BESIDE_TOKEN2WAV_STATS} == dict.fromkeys(BESIDE_TOKEN2WAV_STATS, 0.0)


async def test_without_token2wav_calls_the_counters_are_absent():
    """The single layout's LLM and a CPU engine's: no token2wav in the process, so no names (0 would say that no
    step ran beside a call)."""
    decoder = HookedDecoder(1, {})
    with scheduling(decoder, max_waiting=1) as scheduler:
        assert await collect(scheduler.submit("r", Script(base=0, count=3))) == [0, 1, 2]
        stats = scheduler.stats.snapshot()
    assert stats["llm_steps_total"] == 3
    assert not set(BESIDE_TOKEN2WAV_STATS) & set(stats)
    assert not set(BESIDE_TOKEN2WAV_STATS) & set(LLM_STATS)


async def test_observing_alone_never_waits_and_counts_the_steps_beside_another_threads_call():
    """`observe_token2wav` without `yield_to` (llm_yield off): a lone stream past its first chunk keeps decoding
    while the token2wav worker's call runs, and those steps are beside it."""
    decoder = ScriptedDecoder(num_slots=2)
    calls = Token2WavCalls()
    with scheduling(decoder, max_waiting=1) as scheduler:
        scheduler.observe_token2wav(calls)
        deliveries = scheduler.submit("lone", Script(base=0, count=None), deliver_at=(1,)).deliveries().__aiter__()
        await deliveries.__anext__()
        with token2wav_call(calls):
            assert await steps_while(decoder, 0.1) > 0
        await asyncio.sleep(0.05)  # the step in flight when the call ended, if any, ends
        assert scheduler.cancel("lone")
        async for _ in deliveries:
            pass
        stats = scheduler.stats.snapshot()
    assert stats["llm_yield_seconds_total"] == 0
    assert 0 < stats["llm_steps_beside_token2wav_total"] < stats["llm_steps_total"]
    assert 0 < stats["llm_step_beside_token2wav_seconds_total"] < stats["llm_step_seconds_total"]


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_the_steps_beside_are_those_during_the_token2wav_services_call():
    """The token2wav service marks its engine calls (as the colocated engine's does): the LLM steps while its call
    is held are beside it, those after it are not."""
    calls = Token2WavCalls()
    engine = FakeEngine()
    service = Token2WavService(engine, calls=calls)
    decoder = ScriptedDecoder(num_slots=1)
    try:
        with scheduling(decoder, max_waiting=1) as scheduler:
            scheduler.observe_token2wav(calls)
            deliveries = scheduler.submit("lone", Script(base=0, count=None), deliver_at=(1,)).deliveries().__aiter__()
            await deliveries.__anext__()
            engine.gate.clear()
            audio = asyncio.create_task(service.process("s", np.arange(8), PROMPT, chunk(0, 5), seed=1))
            await until(lambda: calls.busy)
            during = await steps_while(decoder, 0.1)
            engine.gate.set()
            await audio
            # the service's worker marks the call's end after the audio is handed over, and with the scripted
            # decoder's thread spinning it may get the GIL late: the steps after the call begin once it has
            await until(lambda: not calls.busy)
            await asyncio.sleep(0.05)  # the step in flight when the call ended, if any, ends
            after = await steps_while(decoder, 0.1)
            assert scheduler.cancel("lone")
            async for _ in deliveries:
                pass
            stats = scheduler.stats.snapshot()
    finally:
        service.shutdown()
    assert during > 0 and after > 0 and calls.started == 1
    beside = stats["llm_steps_beside_token2wav_total"]
    assert during <= beside <= stats["llm_steps_total"] - after


def test_stats_are_declared_before_a_listener_attaches():
    """An exporter makes its metrics from the names it sees when it attaches (`MetricsExporter`): names declared
    later would never reach it."""
    stats = Stats(("a_total",))
    stats.declare(("a_total", "b_total"))
    assert stats.snapshot() == {"a_total": 0.0, "b_total": 0.0}
    stats.add_listener(lambda name, value: None)
    stats.declare(("b_total",))  # already there: nothing changes
    with pytest.raises(RuntimeError, match="after a listener"):
        stats.declare(("c_total",))
    assert set(stats.snapshot()) == {"a_total", "b_total"}
