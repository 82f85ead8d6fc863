"""DiTBatchedToken2Wav (micro random DiT): the orchestrator's UNet-schedule chunks drive DiT streams; one engine call
of mixed jobs equals each job alone, bad jobs fail alone, a voice's prompt cache is computed once."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.testing.dit import write_dit_model
from cosyvoice2.streaming import Chunk, ChunkSchedule
from speech_serving.engines import DiTBatchedToken2Wav
from speech_serving.errors import InvalidInput
from speech_serving.io_struct import PromptTensors
from speech_serving.token2wav import Work

AUDIO_ATOL = 2e-3  # batched rows equal solo rows to float rounding, amplified by the random HiFT


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> DiTBatchedToken2Wav:
    return DiTBatchedToken2Wav(load_dit_token2wav(write_dit_model(tmp_path_factory.mktemp("dit"), seed=2)))


def prompt(rng: np.random.Generator, tokens: int) -> PromptTensors:
    return PromptTensors(rng.integers(0, 6561, tokens).astype(np.int32),
                         (rng.standard_normal((2 * tokens, 80)) - 5).astype(np.float32),
                         rng.standard_normal(192).astype(np.float32))


def test_orchestrator_chunks_and_offline_jobs_batch_like_alone(engine):
    rng = np.random.default_rng(0)
    voices = [prompt(rng, 9), prompt(rng, 14)]
    schedule = ChunkSchedule(first_hop=5, growth=2)
    streams = [(voices[0], rng.integers(0, 6561, 37).astype(np.int32), 3),
               (voices[1], rng.integers(0, 6561, 22).astype(np.int32), 4)]
    offline = (voices[1], rng.integers(0, 6561, 11).astype(np.int32), 5)
    plans = [schedule.chunks(t.size) for _, t, _ in streams]

    def round_work(states, index):
        work = []
        for state, (_, tokens, _), plan in zip(states, streams, plans):
            if index < len(plan):
                sent = plan[index - 1].feed if index else 0
                work.append(Work(state, tokens[sent: plan[index].feed], plan[index]))
        return work

    rounds = max(map(len, plans))
    states = [engine.open(v, seed) for v, _, seed in streams]
    alone = [[engine.run([w])[0] for w in round_work(states, i)] for i in range(rounds)]
    alone_offline = engine.run([Work(engine.open(offline[0], offline[2]), offline[1], None)])[0]
    assert len(engine.voices) == 2  # three streams, two voices

    states = [engine.open(v, seed) for v, _, seed in streams]
    bad_token = Work(engine.open(voices[0], 1), np.array([3, 10**6], np.int32), None)
    bad_chunk = Work(engine.open(voices[1], 2), rng.integers(0, 6561, 30).astype(np.int32),
                     Chunk(start=7, stop=20, feed=23, final=False))  # does not continue its fresh stream
    together = []
    for i in range(rounds):
        extra = [Work(engine.open(offline[0], offline[2]), offline[1], None), bad_token, bad_chunk] if i == 0 else []
        results = engine.run(round_work(states, i) + extra)
        if i == 0:
            *results, off, token_error, chunk_error = results
            np.testing.assert_allclose(off, alone_offline, atol=AUDIO_ATOL)
            assert isinstance(token_error, InvalidInput) and isinstance(chunk_error, ValueError)
        together.append(results)
    for got, want in zip(together, alone):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert not isinstance(a, Exception)
            np.testing.assert_allclose(a, b, atol=AUDIO_ATOL)
    samples = engine.engine.samples_per_token
    for index, (_, tokens, _) in enumerate(streams):
        assert sum(r[index].size for r in together if index < len(r)) == tokens.size * samples
    assert alone_offline.size == offline[1].size * samples and np.abs(alone_offline).max() > 0
