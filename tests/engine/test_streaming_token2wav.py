"""Streaming token2wav on the tiny model: lengths, schedule, seamless joins, state isolation
(docs/reference/cosyvoice2.md#streaming-schedule).

Seamlessness is measured against a *seamless reference*: one HiFT decode of the whole mel the stream should
produce (one chunk-masked flow call over the non-final part + the full-attention final call, computed here
directly with the flow) driven by the very source signal the stream's HiFT calls used (recorded). Away from
HiFT call edges the stream must equal it to float rounding; in each cross-fade window the stream must be
clearly closer to it than the new chunk alone (which is what the stream would emit without the cross-fade).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from cosyvoice2.streaming import Token2Wav

SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples
OVERLAP = 3840  # 8 cached mel frames x 480
# HiFT's receptive field is about 13 mel frames either side at these kernel/dilation sizes; 15 frames is safe
EDGE_MARGIN = 15 * 480


@dataclass
class VocodeCall:
    mel: torch.Tensor
    source: torch.Tensor
    audio: torch.Tensor


class RecordingToken2Wav(Token2Wav):
    """Token2Wav that keeps every HiFT call's input mel, source and raw (un-faded) audio."""

    def __init__(self, engine: Token2Wav) -> None:
        super().__init__(engine.flow, engine.hift, engine.config)
        self.calls: list[VocodeCall] = []

    def vocode_batch(self, mels, cache_sources, generators):
        results = super().vocode_batch(mels, cache_sources, generators)
        for mel, (audio, source) in zip(mels, results):
            self.calls.append(VocodeCall(mel.clone(), source.clone(), audio.clone()))
        return results


def random_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 6561, n).tolist()


def run_stream(engine: Token2Wav, prompt, tokens: list[int], seed: int, step: int | None = None):
    """Push `tokens` (all at once, or `step` at a time); returns (chunks, tokens pushed when each appeared)."""
    stream = engine.open_stream(engine.flow_prompt(prompt), engine.new_generator(seed))
    chunks, pushed_at = [], []
    step = step or len(tokens)
    for i in range(0, len(tokens), step):
        for chunk in stream.push(tokens[i : i + step]):
            chunks.append(chunk)
            pushed_at.append(min(i + step, len(tokens)))
    chunks.append(stream.finish())
    return chunks, pushed_at, stream


@pytest.fixture(scope="module")
def recorded(tiny_engine, tiny_prompt_unaligned):
    """One 300-token stream with a 40-token prompt (hops 35, 50, 100, 100, final 15)."""
    engine = RecordingToken2Wav(tiny_engine.token2wav_engine)
    tokens = random_tokens(300, seed=11)
    chunks, _, stream = run_stream(engine, tiny_prompt_unaligned, tokens, seed=5)
    return engine, tokens, chunks, stream


def expected_chunk_lengths(prompt_tokens: int, n_tokens: int) -> list[int]:
    """The reference schedule's arithmetic (docs/reference/cosyvoice2.md#streaming-schedule), written out
    independently of ChunkSchedule."""
    hop = 25 + (-prompt_tokens) % 25
    base, start, lengths = 25, 0, []
    while n_tokens - start >= hop + 3:
        lengths.append(hop * SAMPLES_PER_TOKEN - (OVERLAP if not lengths else 0))
        start += hop
        base = min(100, base * 2)
        hop = base
    lengths.append((n_tokens - start) * SAMPLES_PER_TOKEN + (OVERLAP if lengths else 0))
    return lengths


def test_total_length_equals_offline(tiny_engine, tiny_prompt_unaligned, recorded) -> None:
    _, tokens, chunks, _ = recorded
    offline = tiny_engine.token2wav(tokens, tiny_prompt_unaligned, seed=5)
    assert len(offline) == SAMPLES_PER_TOKEN * len(tokens)
    assert sum(len(c) for c in chunks) == len(offline)


def test_chunk_lengths_follow_the_schedule(recorded) -> None:
    _, tokens, chunks, stream = recorded
    assert [len(c) for c in chunks] == expected_chunk_lengths(40, len(tokens))
    assert [c.hop for c in stream.chunks] == [35, 50, 100, 100, 15]


def test_chunks_appear_as_soon_as_hop_plus_lookahead_tokens_exist(tiny_engine, tiny_prompt) -> None:
    engine = tiny_engine.token2wav_engine
    tokens = random_tokens(200, seed=3)
    chunks, pushed_at, _ = run_stream(engine, tiny_prompt, tokens, seed=1, step=1)
    assert pushed_at == [25 + 3, 75 + 3, 175 + 3]  # aligned prompt (75 tokens): hops 25, 50, 100
    assert [len(c) for c in chunks] == expected_chunk_lengths(75, 200)


def test_second_stream_starts_with_the_first_hop_again(tiny_engine, tiny_prompt) -> None:
    # upstream keeps the grown hop on the model object; ours must not
    engine = tiny_engine.token2wav_engine
    tokens = random_tokens(130, seed=4)
    first, _, _ = run_stream(engine, tiny_prompt, tokens, seed=1)
    second, _, _ = run_stream(engine, tiny_prompt, tokens, seed=1)
    assert [len(c) for c in second] == [len(c) for c in first] == expected_chunk_lengths(75, 130)


@pytest.fixture(scope="module")
def seamless_reference(tiny_prompt_unaligned, recorded):
    engine, tokens, chunks, stream = recorded
    flow, prompt = engine.flow, engine.flow_prompt(tiny_prompt_unaligned)
    final_start = stream.chunks[-1].start
    with torch.inference_mode():
        token = torch.tensor([tokens])
        streamed = flow.inference(token[:, : final_start + 3], prompt.tokens, prompt.mel, prompt.xvector,
                                  streaming=True, finalize=False)
        tail = flow.inference(token, prompt.tokens, prompt.mel, prompt.xvector, streaming=False, finalize=True)
        mel = torch.cat([streamed, tail[:, :, 2 * final_start :]], dim=2)
        source = torch.cat([engine.calls[0].source] + [c.source[:, :, OVERLAP:] for c in engine.calls[1:]], dim=2)
        audio = engine.hift.decode(mel, source)[0]
    return mel, audio.numpy()


def test_stream_mel_is_chunked_prefix_plus_full_attention_tail(recorded, seamless_reference) -> None:
    engine = recorded[0]
    mel = torch.cat([engine.calls[0].mel] + [c.mel[:, :, 8:] for c in engine.calls[1:]], dim=2)
    assert mel.shape == seamless_reference[0].shape
    torch.testing.assert_close(mel, seamless_reference[0], atol=1e-4, rtol=0)


def join_positions(chunks: list[np.ndarray]) -> np.ndarray:
    return np.cumsum([len(c) for c in chunks])[:-1]


def test_stream_equals_seamless_reference_away_from_hift_edges(recorded, seamless_reference) -> None:
    audio = np.concatenate(recorded[2])
    joins = join_positions(recorded[2])
    # HiFT call k spans [join_k, join_{k+1} + OVERLAP): both edges are where chunked vocoding may differ
    edges = np.concatenate([joins, joins + OVERLAP])
    distance = np.abs(np.arange(len(audio))[:, None] - edges[None, :]).min(axis=1)
    interior = distance > EDGE_MARGIN
    assert interior.sum() > len(audio) // 2
    np.testing.assert_allclose(audio[interior], seamless_reference[1][interior], atol=1e-4, rtol=0)


def test_cross_fade_hides_the_chunk_edges(recorded, seamless_reference) -> None:
    engine, _, chunks, _ = recorded
    audio, reference = np.concatenate(chunks), seamless_reference[1]
    joins = join_positions(chunks)
    steps = np.abs(np.diff(audio))
    inside = np.ones_like(steps, dtype=bool)
    inside[joins - 1] = False
    for k, join in enumerate(joins, start=1):
        window = slice(join, join + OVERLAP)
        # without the fade the stream would emit the new call's first samples, computed with too little left context
        unfaded_error = np.abs(engine.calls[k].audio[:OVERLAP].numpy() - reference[window]).max()
        faded_error = np.abs(audio[window] - reference[window]).max()
        assert faded_error <= 0.75 * unfaded_error, (k, faded_error, unfaded_error)
        assert steps[join - 1] <= steps[inside].max()


def test_interleaved_streams_equal_each_alone(tiny_engine, tiny_prompt, tiny_prompt_unaligned) -> None:
    engine = tiny_engine.token2wav_engine
    jobs = [(tiny_prompt, random_tokens(160, seed=21), 7), (tiny_prompt_unaligned, random_tokens(140, seed=22), 8)]
    alone = [np.concatenate(run_stream(engine, p, toks, seed)[0]) for p, toks, seed in jobs]

    streams = [engine.open_stream(engine.flow_prompt(p), engine.new_generator(seed)) for p, _, seed in jobs]
    outputs: list[list[np.ndarray]] = [[], []]
    for i in range(0, 160, 9):
        for index, (stream, (_, toks, _)) in enumerate(zip(streams, jobs)):
            outputs[index] += stream.push(toks[i : i + 9])
    for index, stream in enumerate(streams):
        outputs[index].append(stream.finish())
    for together, single in zip(outputs, alone):
        np.testing.assert_array_equal(np.concatenate(together), single)


def test_finish_twice_and_push_after_finish_are_errors(tiny_engine, tiny_prompt) -> None:
    engine = tiny_engine.token2wav_engine
    stream = engine.open_stream(engine.flow_prompt(tiny_prompt), engine.new_generator(0))
    stream.push(random_tokens(10, seed=1))
    assert len(stream.finish()) == 10 * SAMPLES_PER_TOKEN
    with pytest.raises(RuntimeError):
        stream.push([1])
    with pytest.raises(RuntimeError):
        stream.finish()
