"""Batched token2wav across requests: rows of different lengths in one flow and one HiFT forward must give
each row exactly what it gets alone (fp32 CPU), streams keep their own caches and noise, and a failed batch
changes nothing."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from cosyvoice2.flow import CausalFlow
from cosyvoice2.hift import HiFTGenerator
from cosyvoice2.streaming import Chunk, Token2Wav
from tests.engine.micro_modules import TINY_FLOW, TINY_HIFT, randomized

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    return randomized(lambda: HiFTGenerator(TINY_HIFT), seed=4)


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.manual_seed(3)
    return randomized(lambda: CausalFlow(TINY_FLOW), seed=3)


def hift_rows(hift: HiFTGenerator, frames: list[int], caches: list[int]):
    gen = torch.Generator().manual_seed(0)
    mels = [torch.randn(1, 80, m, generator=gen) * 2 for m in frames]
    cache_sources = [torch.randn(1, 1, c, generator=gen) * 0.5 if c else None for c in caches]
    noises = [hift.draw_noise(1, m, torch.Generator().manual_seed(i)) for i, m in enumerate(frames)]
    return mels, cache_sources, noises


def test_hift_rows_of_different_lengths_equal_each_row_alone(hift: HiFTGenerator) -> None:
    frames, caches = [40, 58, 13, 58], [0, 3840, 0, 3840]
    mels, cache_sources, noises = hift_rows(hift, frames, caches)
    batched = hift.inference_batch(mels, cache_sources, noises)
    for m, mel, cache, noise, (audio, source) in zip(frames, mels, cache_sources, noises, batched):
        alone_audio, alone_source = hift.inference(mel, cache, noise)
        assert audio.shape == (480 * m,) and source.shape == (1, 1, 480 * m)
        assert alone_audio.abs().max() > 0.05  # a real signal, not silence
        torch.testing.assert_close(audio, alone_audio[0], **TOL)
        torch.testing.assert_close(source, alone_source, **TOL)
    # the cached source really is forced into its row only
    torch.testing.assert_close(batched[1][1][:, :, :3840], cache_sources[1])


def test_hift_istft_equals_torch_istft(hift: HiFTGenerator) -> None:
    gen = torch.Generator().manual_seed(1)
    magnitude, phase = torch.rand(2, 9, 241, generator=gen) * 3, torch.randn(2, 9, 241, generator=gen)
    ours = hift.synthesize(magnitude, phase, torch.tensor([2, 2]))
    spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    reference = torch.istft(spectrum, 16, 4, 16, window=hift.stft_window).clamp(-0.99, 0.99)
    assert reference.abs().max() > 0.1
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("final", [False, True])
@torch.inference_mode()
def test_flow_rows_of_different_lengths_equal_each_call_alone(flow: CausalFlow, final: bool) -> None:
    """Different prompt lengths (so different chunk grids) and token counts in one forward."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(20, 31), (7, 12), (33, 60)]  # (prompt tokens, tokens)
    tokens = [torch.randint(0, 6561, (n,), generator=gen) for _, n in shapes]
    prompts = [torch.randint(0, 6561, (p,), generator=gen) for p, _ in shapes]
    feats = [torch.randn(2 * p, 80, generator=gen) for p, _ in shapes]
    xvectors = torch.randn(len(shapes), 192, generator=gen)
    batched = flow.inference_batch(tokens, prompts, feats, xvectors, streaming=not final, finalize=final)
    for i, (_, n) in enumerate(shapes):
        alone = flow.inference(tokens[i][None], prompts[i][None], feats[i][None], xvectors[i : i + 1],
                               streaming=not final, finalize=final)[0]
        assert batched[i].shape == (80, 2 * (n if final else n - 3))
        assert alone.abs().max() > 0.1
        torch.testing.assert_close(batched[i], alone, **TOL)


@torch.inference_mode()
def test_cfm_graph_padding_of_rows_and_frames_is_exact(flow: CausalFlow) -> None:
    """What the CFM graph path replays: 3 rows of 70 frames padded to 4 rows and 128 frames (checked on CPU)."""
    gen = torch.Generator().manual_seed(2)
    mu, spks = torch.randn(3, 80, 70, generator=gen), torch.randn(3, 80, generator=gen)
    cond = torch.zeros(3, 80, 70)
    cond[:, :, :30] = torch.randn(3, 80, 30, generator=gen)
    mask = torch.ones(3, 1, 70)
    mask[1, :, 50:] = 0  # a row that is itself padded
    padded = flow.decoder.cuda_graphs.pad(mu, mask, spks, cond)
    assert padded[0].shape == (4, 80, 128)
    want = flow.decoder.solve(mu, mask, spks, cond, streaming=True)
    got = flow.decoder.solve(*padded, streaming=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:3, :, :50], want[:, :, :50], **TOL)
    torch.testing.assert_close(got[[0, 2], :, :70], want[[0, 2]], **TOL)


# -- streams (tiny model from the engine conftest) -----------------------------------------------------
def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 6561, n).tolist()


class RecordingToken2Wav(Token2Wav):
    """Keeps the mel of every HiFT row, per generator (one generator per stream)."""

    def __init__(self, engine: Token2Wav) -> None:
        super().__init__(engine.flow, engine.hift, engine.config)
        self.mels_by_generator: dict[int, list[torch.Tensor]] = defaultdict(list)

    def vocode_batch(self, mels, cache_sources, generators):
        for mel, generator in zip(mels, generators):
            self.mels_by_generator[id(generator)].append(mel.clone())
        return super().vocode_batch(mels, cache_sources, generators)


def alone(engine, prompt, tokens: list[int], seed: int):
    stream = engine.open_stream(engine.flow_prompt(prompt), engine.new_generator(seed))
    return stream.push(tokens) + [stream.finish()], stream.generator


def test_streams_and_offline_jobs_run_together_equal_each_alone(tiny_engine, tiny_prompt, tiny_prompt_unaligned):
    """Three streams (two voices, so different hops and shapes; final and non-final chunks mix) and one offline
    utterance share every call; chunk lengths, HiFT inputs and audio equal their solo runs.

    The flow rows equal their solo calls to float rounding (~1e-6, padded shapes round differently); the tiny
    random HiFT amplifies a 1e-6 mel change about 100x (measured: 8.5e-5 on peaks of 0.12), hence the audio
    tolerance. A wrong cache, noise draw or fade would be off by the signal's size.
    """
    engine = RecordingToken2Wav(tiny_engine.token2wav_engine)
    jobs = [(tiny_prompt, random_tokens(160, 21), 7), (tiny_prompt_unaligned, random_tokens(140, 22), 8),
            (tiny_prompt_unaligned, random_tokens(60, 23), 9)]
    expected = [alone(engine, p, toks, seed) for p, toks, seed in jobs]
    offline_tokens = random_tokens(90, 24)
    offline_generator = engine.new_generator(5)
    expected_offline = engine.offline(offline_tokens, engine.flow_prompt(tiny_prompt), offline_generator)

    streams = [engine.open_stream(engine.flow_prompt(p), engine.new_generator(seed)) for p, _, seed in jobs]
    for stream, (_, toks, _) in zip(streams, jobs):
        stream.extend(toks)
    got: list[list[np.ndarray]] = [[] for _ in jobs]
    offline = [engine.offline_job(offline_tokens, engine.flow_prompt(tiny_prompt), engine.new_generator(5))]
    offline_audio, calls = None, 0
    while any(not s.finished for s in streams):
        work = [(s, s.next_chunk(finished=True)) for s in streams if not s.finished]
        results = engine.run_chunks(work + offline)
        if offline:
            offline_audio, offline = results.pop(), []
        for (stream, _), audio in zip(work, results):
            got[streams.index(stream)].append(audio)
        calls += 1
    assert calls == max(len(chunks) for chunks, _ in expected) > 2

    for stream, chunks, (want, solo_generator) in zip(streams, got, expected):
        assert [len(c) for c in chunks] == [len(c) for c in want]
        batched_mels = engine.mels_by_generator[id(stream.generator)]
        solo_mels = engine.mels_by_generator[id(solo_generator)]
        assert [m.shape for m in batched_mels] == [m.shape for m in solo_mels]
        for batched_mel, solo_mel in zip(batched_mels, solo_mels):
            torch.testing.assert_close(batched_mel, solo_mel, **TOL)
        np.testing.assert_allclose(np.concatenate(chunks), np.concatenate(want), rtol=0, atol=2e-3)
    assert offline_audio is not None and offline_audio.size == 90 * 960
    np.testing.assert_allclose(offline_audio, expected_offline, rtol=0, atol=2e-3)


def test_a_failed_call_leaves_the_streams_as_they_were(tiny_engine, tiny_prompt, monkeypatch):
    engine = tiny_engine.token2wav_engine
    tokens = random_tokens(40, 31)
    want, _ = alone(engine, tiny_prompt, tokens, seed=3)

    stream = engine.open_stream(engine.flow_prompt(tiny_prompt), engine.new_generator(3))
    stream.extend(tokens)
    chunk = stream.next_chunk(finished=True)

    def broken(*args, **kwargs):
        raise RuntimeError("vocoder failed")

    with monkeypatch.context() as patch:  # fails after the noise was drawn from the stream's generator
        patch.setattr(engine.hift, "inference_batch", broken)
        with pytest.raises(RuntimeError, match="vocoder failed"):
            engine.run_chunks([(stream, chunk)])
    assert stream.chunks == []
    got = engine.run_chunks([(stream, chunk)]) + [stream.finish()]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))


def test_a_chunk_that_does_not_continue_its_stream_is_refused(tiny_engine, tiny_prompt) -> None:
    engine = tiny_engine.token2wav_engine
    stream = engine.open_stream(engine.flow_prompt(tiny_prompt), engine.new_generator(0))
    stream.extend(random_tokens(40, 1))
    with pytest.raises(ValueError):
        engine.run_chunks([(stream, Chunk(start=5, stop=30, feed=33, final=False))])
    with pytest.raises(ValueError):
        engine.run_chunks([(stream, Chunk(start=0, stop=45, feed=45, final=True))])  # tokens not added yet
    chunk = stream.next_chunk(finished=False)
    with pytest.raises(ValueError):
        engine.run_chunks([(stream, chunk), (stream, chunk)])
