"""BatchedToken2Wav (tiny model): one engine call with streaming chunks of different voices and positions,
offline utterances of different lengths and bad jobs gives every good job the audio it gets alone, and fails
the bad ones alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from cosyvoice2.streaming import Chunk
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import PromptTensors
from speech_serving.token2wav import Work
from tests.serving.test_token2wav_service import tiny_token2wav  # noqa: F401 - the shared module fixture

# The flow rows equal their solo calls to float rounding; the tiny random HiFT amplifies that ~100x
# (tests/engine/test_token2wav_batching.py), so audio is compared at 2e-3 on peaks of ~0.1.
AUDIO_ATOL = 2e-3


def prompt(rng: np.random.Generator, tokens: int) -> PromptTensors:
    return PromptTensors(rng.integers(0, 100, tokens).astype(np.int32),
                         rng.standard_normal((2 * tokens, 80)).astype(np.float32),
                         rng.standard_normal(192).astype(np.float32))


def test_one_call_of_mixed_jobs_equals_each_job_alone(tiny_token2wav):  # noqa: F811
    engine, schedule = tiny_token2wav
    rng = np.random.default_rng(1)
    voices = [prompt(rng, 6), prompt(rng, 13)]  # different prompt lengths: different hops and chunk grids
    streams = [(voices[0], rng.integers(0, 100, 70).astype(np.int32), 3),
               (voices[1], rng.integers(0, 100, 50).astype(np.int32), 4),
               (voices[1], rng.integers(0, 100, 30).astype(np.int32), 5)]
    offline = [(voices[0], rng.integers(0, 100, 41).astype(np.int32), 6),
               (voices[1], rng.integers(0, 100, 17).astype(np.int32), 7)]
    plans = [replace(schedule, prompt_tokens=v.speech_tokens.size).chunks(t.size) for v, t, _ in streams]

    def jobs_of_round(states, index: int) -> list[Work]:
        work = []
        for state, (_, tokens, _), plan in zip(states, streams, plans):
            if index < len(plan):
                sent = plan[index - 1].feed if index else 0
                work.append(Work(state, tokens[sent : plan[index].feed], plan[index]))
        return work

    # alone: every job in its own engine call
    states = [engine.open(v, seed) for v, _, seed in streams]
    alone = [engine.run([w])[0] for index in range(max(map(len, plans))) for w in jobs_of_round(states, index)]
    alone_offline = [engine.run([Work(engine.open(v, seed), t, None)])[0] for v, t, seed in offline]

    # together: one call per round; round 0 also carries the offline jobs and two bad jobs
    states = [engine.open(v, seed) for v, _, seed in streams]
    bad_token = Work(engine.open(voices[0], 1), np.array([5, 10**6], np.int32), None)
    bad_chunk = Work(engine.open(voices[1], 2), rng.integers(0, 100, 40).astype(np.int32),
                     Chunk(start=7, stop=20, feed=23, final=False))  # does not continue its (fresh) stream
    together, together_offline = [], []
    for index in range(max(map(len, plans))):
        work = jobs_of_round(states, index)
        extra = []
        if index == 0:
            extra = [Work(engine.open(v, seed), t, None) for v, t, seed in offline] + [bad_token, bad_chunk]
        results = engine.run(work + extra)
        if extra:
            *together_offline, token_error, chunk_error = results[len(work):]
            assert isinstance(token_error, InvalidInput)
            assert isinstance(chunk_error, ValueError)
        together += results[: len(work)]
    assert sum(map(len, plans)) == len(alone) == len(together) and max(map(len, plans)) >= 3
    for got, want in zip(together + together_offline, alone + alone_offline):
        assert not isinstance(got, Exception) and not isinstance(want, Exception), (got, want)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=AUDIO_ATOL)
    assert [a.size for a in together_offline] == [41 * 960, 17 * 960]
    assert sum(a.size for a in together) == sum(t.size for _, t, _ in streams) * 960


def test_the_allocator_statistics_are_read_at_most_once_a_period(monkeypatch):
    """The service asks for the allocator's retries after every call; reading them builds a dict of every allocator
    statistic, so a period's calls share one reading (and a CPU flow reads none)."""
    from types import SimpleNamespace

    from speech_serving import engines

    reads = []

    def memory_stats(device):
        reads.append(device)
        return {"num_alloc_retries": len(reads)}

    clock = iter([100.0, 100.2, 100.9, 101.1, 101.3])
    monkeypatch.setattr(engines.torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(engines.time, "monotonic", lambda: next(clock))
    gpu = engines._BatchedStreams()
    gpu.engine = SimpleNamespace(flow_device=torch.device("cuda", 1))
    assert [gpu.allocator_retries() for _ in range(5)] == [(1,), (1,), (1,), (2,), (2,)]
    assert reads == [torch.device("cuda", 1)] * 2
    cpu = engines._BatchedStreams()
    cpu.engine = SimpleNamespace(flow_device=torch.device("cpu"))
    assert cpu.allocator_retries() == (0,) and len(reads) == 2
