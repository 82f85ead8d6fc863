"""The cached flow's encoder pass padded to its CUDA-graph buckets (`cosyvoice2/flow/cached_encoder.py`), on CPU.

`EncoderGraphs.emulate` runs the bucketed path eagerly: rows, new tokens and history padded to a bucket, the history
gathered into the static key buffers (which keep stale values of earlier calls in their padding). Each row's mu and
new caches must equal running that row alone, unpadded - for first chunks over a voice prefix or none, later
chunks, final chunks and off-grid chunks in one call - and a whole stream must give the same mel and audio.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
from cosyvoice2.streaming import ChunkSchedule, Token2Wav
from cosyvoice2.testing.models import tiny_config
from tests.gpu.test_flow_cache import random_flow

TOLERANCE = 2e-5  # fp32; padding changes only summation order


@pytest.fixture(scope="module")
def flow():
    return random_flow(tiny_config().flow, torch.device("cpu"))


def tokens(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, n)).long()


class Voice:
    """A voice prompt with its shared prefix (computed by `runner`)."""

    def __init__(self, runner: CachedFlowRunner, prompt_tokens: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        device = runner.flow.input_embedding.weight.device
        self.tokens = tokens(prompt_tokens, seed, runner.flow.config.vocab_size).to(device)
        self.mel = torch.randn(2 * prompt_tokens, 80, generator=gen).to(device)
        self.spks = runner.project_speaker(torch.randn(1, 192, generator=gen).to(device))[0]
        self.prefix = runner.prefix(self.tokens, self.mel, self.spks)

    def row(self, speech: torch.Tensor, own: CachedSegment, stop: int, final: bool) -> CachedRow:
        """A row emitting generated tokens up to `stop` (generated-token index; the prompt is added)."""
        p = self.tokens.numel()
        feed = stop if final else stop + 3
        return CachedRow(torch.cat([self.tokens, speech[:feed]]), self.mel, self.spks, self.prefix, own,
                         stop=p + stop, final=final, keep=not final)


def advanced(runner: CachedFlowRunner, voice: Voice, speech: torch.Tensor, stops: list[int]) -> CachedSegment:
    """A stream's own caches after non-final chunks ending at `stops`."""
    own = CachedSegment()
    for stop in stops:
        runner.run([voice.row(speech, own, stop, final=False)])
    return own


def assert_close(a: torch.Tensor | None, b: torch.Tensor | None, what: str, tolerance: float = TOLERANCE) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape, (what, a.shape, b.shape)
        deviation = (a - b).abs().max().item()
        assert deviation <= tolerance, (what, deviation)


def mixed_rows(eager: CachedFlowRunner) -> list[CachedRow]:
    """Six rows of two voices, one of each kind a call can mix (their caches computed by `eager`)."""
    vocab, device = eager.flow.config.vocab_size, eager.flow.input_embedding.weight.device
    long_voice = Voice(eager, prompt_tokens=70, seed=1)  # prefix: 50 tokens
    short_voice = Voice(eager, prompt_tokens=20, seed=2)  # no prefix: its streams start at token 0
    assert long_voice.prefix.encoder.tokens == 50 and short_voice.prefix.encoder.tokens == 0
    speech = [tokens(300, seed=10 + s, vocab=vocab).to(device) for s in range(6)]
    rows = [
        long_voice.row(speech[0], CachedSegment(), 30, final=False),  # aligned first chunk over the prefix
        short_voice.row(speech[1], CachedSegment(), 30, final=False),  # first chunk from token 0
        long_voice.row(speech[2], advanced(eager, long_voice, speech[2], [30, 80]), 180, final=False),  # later
        long_voice.row(speech[3], advanced(eager, long_voice, speech[3], [30]), 62, final=True),  # final, chunked
        short_voice.row(speech[4], CachedSegment(), 12, final=True),  # a whole short stream in one final chunk
        long_voice.row(speech[5], CachedSegment(), 25, final=False),  # off grid: keeps 25 of its 45 tokens
    ]
    hist = [row.start for row in rows]
    assert hist == [50, 0, 150, 100, 0, 50] and [row.kept_tokens(25) for row in rows] == [50, 50, 100, 0, 0, 25]
    return rows


def assert_rows_equal_alone(padded: CachedFlowRunner, eager: CachedFlowRunner, rows: list[CachedRow],
                            new_tokens: int) -> None:
    """One padded call of `rows` (bucket of `new_tokens` new tokens) against each row alone, unpadded."""
    mu, caches = padded.encoder.run(rows)
    for b, row in enumerate(rows):
        ref_mu, (ref,) = eager.encoder.run([row])
        frames = 2 * (row.stop - row.start)
        assert ref_mu.size(2) == frames and mu.size(2) == 2 * new_tokens  # the alone call is unpadded, ours is not
        assert_close(mu[b, :, :frames], ref_mu[0], f"mu of row {b}")
        got = caches[b]
        assert got.tokens == ref.tokens == row.kept_tokens(25)
        for name in ("kv", "up_kv", "up_tail"):
            assert_close(getattr(got, name), getattr(ref, name), f"{name} of row {b}")


@torch.inference_mode()
def test_padded_bucketed_encoder_equals_each_row_alone(flow) -> None:
    eager = CachedFlowRunner(flow, graphs=False)
    padded = CachedFlowRunner(flow)
    graphs = padded.encoder.graphs
    graphs.emulate = True
    graphs.rows, graphs.new_tokens, graphs.history_tokens = (1, 2, 4, 8), (32, 64, 128), (64, 128, 256)
    rows = mixed_rows(eager)
    assert_rows_equal_alone(padded, eager, rows, 128)
    # again in another order: now the buffers' padding holds the first call's keys/values
    assert_rows_equal_alone(padded, eager, rows[::-1], 128)
    assert set(graphs._captured) == {(8, 128, 256)}  # 6 rows as 8, 70 new tokens as 128, history 150 as 256


@torch.inference_mode()
def test_non_final_rows_equal_the_recomputing_encoder(flow) -> None:
    """The bucketed pass's mu of a non-final chunk equals the flow's own encoder over prompt + all tokens."""
    runner = CachedFlowRunner(flow)
    runner.encoder.graphs.emulate = True
    voice = Voice(runner, prompt_tokens=40, seed=3)
    speech = tokens(200, seed=4, vocab=flow.config.vocab_size)
    own = CachedSegment()
    for chunk in ChunkSchedule(prompt_tokens=40).chunks(200)[:-1]:
        row = voice.row(speech, own, chunk.stop, final=False)
        (mu,), (update,) = runner.encoder.run([row])
        whole = flow.encode(speech[None, : chunk.feed], voice.tokens[None], streaming=True, finalize=False)[0]
        frames = 2 * (row.stop - row.start)
        assert_close(mu[:, :frames], whole[:, 2 * row.start : 2 * row.stop], f"chunk {chunk}")
        runner.commit(own, CachedSegment(update))
    assert own.encoder.tokens > 100


@torch.inference_mode()
def test_a_whole_stream_through_the_padded_encoder_equals_the_eager_one(flow) -> None:
    eager = CachedFlowRunner(flow, graphs=False)
    padded = CachedFlowRunner(flow)
    padded.encoder.graphs.emulate = True
    voice = Voice(eager, prompt_tokens=57, seed=5)
    speech = tokens(260, seed=6, vocab=flow.config.vocab_size)
    owns = CachedSegment(), CachedSegment()
    for chunk in ChunkSchedule(prompt_tokens=57, grid=1).chunks(260):  # unaligned: off-grid chunks too
        mels = [runner.run([voice.row(speech, own, chunk.stop, final=chunk.final)])[0]
                for runner, own in zip((eager, padded), owns)]
        assert_close(mels[1], mels[0], f"mel of {chunk}")
    assert len(padded.encoder.graphs._captured) >= 2


def test_token2wav_streams_through_the_padded_encoder(tiny_engine, tiny_prompt_unaligned) -> None:
    base = tiny_engine.token2wav_engine
    audio = []
    for emulate in (False, True):
        engine = Token2Wav(base.flow, base.hift, base.config, flow_cache="chunked")
        engine.cached.encoder.graphs.emulate = emulate
        stream = engine.open_stream(engine.flow_prompt(tiny_prompt_unaligned), engine.new_generator(7))
        speech = tokens(230, seed=8, vocab=base.config.flow.vocab_size).tolist()
        pieces = [piece for i in range(0, 230, 9) for piece in stream.push(speech[i : i + 9])]
        pieces.append(stream.finish())
        audio.append(np.concatenate(pieces))
        assert bool(engine.cached.encoder.graphs._captured) == emulate
    assert audio[0].shape == audio[1].shape == (960 * 230,)
    # mel rounding (~1e-6, the stream test above) grows to ~2e-4 through HiFT, as in tests/engine/test_flow_cache.py
    np.testing.assert_allclose(audio[1], audio[0], atol=1e-3)
