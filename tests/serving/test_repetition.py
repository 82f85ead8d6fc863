"""The loop guard (TensorRT-LLM's stand-in for RAS): where it ends an utterance, and the orchestrator hook."""

from __future__ import annotations

import numpy as np
import pytest

from speech_serving.repetition import LoopGuardConfig
from tests.serving.test_orchestrator import SAMPLES_PER_TOKEN, FakeClients, collect, orchestrator, request

GUARD = LoopGuardConfig(max_run=6, max_period=3, max_cycle_tokens=12)


def cut_of(tokens: list[int], config: LoopGuardConfig = GUARD, batch: int = 5) -> int | None:
    """Where the guard ends `tokens` (an index into them) when they arrive in batches of `batch`."""
    guard = config.start()
    for start in range(0, len(tokens), batch):
        cut = guard.feed(tokens[start : start + batch])
        if cut is not None:
            return start + cut
    return None


def varied(n: int, seed: int = 0) -> list[int]:
    """Tokens without any run or short cycle: every token differs from the 3 before it."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        token = int(rng.integers(0, 6561))
        if token not in out[-3:]:
            out.append(token)
    return out


@pytest.mark.parametrize("batch", [1, 4, 100])
def test_a_run_of_one_token_ends_at_the_run_limit_however_the_tokens_arrive(batch):
    tokens = varied(10) + [7] * 20 + varied(5, seed=1)
    assert cut_of(tokens, batch=batch) == 10 + GUARD.max_run - 1  # the token completing the run is dropped


@pytest.mark.parametrize("period", [2, 3])
def test_a_short_cycle_ends_once_it_covers_the_cycle_limit(period):
    cycle = [11, 12, 13][:period]
    tokens = varied(9) + cycle * 20
    assert cut_of(tokens) == 9 + GUARD.max_cycle_tokens - 1


def test_runs_and_cycles_below_the_limits_and_longer_periods_pass():
    below = varied(8) + [5] * (GUARD.max_run - 1) + varied(8, 1) + [1, 2] * 5 + varied(8, 2)
    assert cut_of(below) is None
    assert cut_of(varied(50) + [1, 2, 3, 4] * 10) is None  # period 4 > max_period
    assert cut_of(varied(5000)) is None


def test_the_default_limits_allow_a_second_of_one_token():
    config = LoopGuardConfig()
    assert cut_of([3] * 24, config) is None and cut_of([3] * 25, config) == 24


@pytest.mark.parametrize("bad", [{"max_run": 1}, {"max_period": 0}, {"max_period": 4, "max_cycle_tokens": 6}])
def test_nonsense_limits_are_refused(bad):
    with pytest.raises(ValueError, match="loop guard limits"):
        LoopGuardConfig(**bad)


async def test_the_orchestrator_ends_a_looping_utterance_and_stops_the_sequence():
    head = list(range(20))  # distinct speech tokens (the fake vocabulary has 50)
    clients = FakeClients(head + [9] * 100, batch=4)
    orch = orchestrator(clients, loop_guard=GUARD)
    [chunk] = await collect(orch, request(), streaming=False)
    kept = 20 + GUARD.max_run - 1
    assert chunk.final and chunk.output_tokens == kept and chunk.waveform.size == kept * SAMPLES_PER_TOKEN
    [(_, sent, *_)] = clients.calls
    assert sent == head + [9] * (GUARD.max_run - 1)
    assert clients.stopped  # the LLM sequence, still running, is stopped
    assert orch.stats.get("orchestrator_loops_cut_total") == 1


async def test_streaming_with_the_guard_hands_over_each_kept_token_once():
    head = list(range(30))
    clients = FakeClients(head + [4, 8] * 60, batch=3)
    orch = orchestrator(clients, loop_guard=GUARD)
    chunks = await collect(orch, request(), streaming=True)
    kept = 30 + GUARD.max_cycle_tokens - 1
    assert chunks[-1].final and chunks[-1].output_tokens == kept
    sent = [t for _, part, *_ in clients.calls for t in part]
    assert sent == (head + [4, 8] * 60)[:kept]


async def test_without_a_guard_a_loop_runs_to_the_llm_s_end():
    clients = FakeClients(list(range(20)) + [9] * 100)
    orch = orchestrator(clients)
    [chunk] = await collect(orch, request(), streaming=False)
    assert chunk.output_tokens == 120 and orch.stats.get("orchestrator_loops_cut_total") == 0
