"""DiT streams: schedule, lengths, per-stream state, prompt caches shared across streams (tiny random model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.testing.dit import write_dit_model
from cosyvoice2.dit.token2wav import Chunk, DiTStreamingConfig, DiTToken2Wav, VoiceCaches

PROMPT_TOKENS = 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> DiTToken2Wav:
    return load_dit_token2wav(write_dit_model(tmp_path_factory.mktemp("dit_tiny"), seed=3))


def voice(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 6561, PROMPT_TOKENS), rng.standard_normal((2 * PROMPT_TOKENS, 80)).astype(np.float32) - 5,
            rng.standard_normal(192).astype(np.float32))


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(100 + seed).integers(0, 6561, n).tolist()


@pytest.fixture(scope="module")
def prompt(engine: DiTToken2Wav):
    return engine.prompt_cache(*voice(0))


def run_stream(engine: DiTToken2Wav, prompt, generated: list[int], seed: int, step: int) -> list[np.ndarray]:
    stream = engine.open_stream(prompt, engine.new_generator(seed))
    out = []
    for i in range(0, len(generated), step):
        out.extend(stream.push(generated[i:i + step]))
    out.append(stream.finish())
    return out


def test_schedule_hops() -> None:
    config = DiTStreamingConfig()
    assert [config.hop(i) for i in range(6)] == [15, 25, 50, 100, 100, 100]
    assert [DiTStreamingConfig(first_hops=(10,), growth=3, max_hop=200).hop(i) for i in range(4)] == [10, 30, 90, 200]
    with pytest.raises(ValueError):
        DiTStreamingConfig(first_hops=(3,))


def test_chunk_sizes_and_total_length(engine: DiTToken2Wav, prompt) -> None:
    generated = tokens(104)
    pieces = run_stream(engine, prompt, generated, seed=1, step=len(generated))
    # hops 15, 25, 50 (+ 3 lookahead each), then the final 14 tokens: the reference's first-chunk sizes
    assert [len(p) for p in pieces[:3]] == [960 * 15 - 3840, 960 * 25, 960 * 50]
    assert sum(len(p) for p in pieces) == 960 * len(generated)
    assert len(pieces[-1]) == 960 * 14 + 3840


def test_token_arrival_does_not_change_audio(engine: DiTToken2Wav, prompt) -> None:
    generated = tokens(45, seed=1)
    at_once = np.concatenate(run_stream(engine, prompt, generated, seed=5, step=len(generated)))
    one_by_one = np.concatenate(run_stream(engine, prompt, generated, seed=5, step=1))
    assert np.array_equal(at_once, one_by_one)
    other_seed = np.concatenate(run_stream(engine, prompt, generated, seed=6, step=len(generated)))
    assert np.abs(other_seed - at_once).max() > 1e-3  # HiFT's source noise comes from the stream's generator


def test_interleaved_streams_share_the_prompt_cache(engine: DiTToken2Wav, prompt) -> None:
    before = [t.clone() for t in (prompt.encoder.lower, prompt.estimator.kv, prompt.estimator.conv)]
    first, second = tokens(48, seed=2), tokens(30, seed=3)
    alone = [np.concatenate(run_stream(engine, prompt, t, seed=9, step=len(t))) for t in (first, second)]
    streams = [engine.open_stream(prompt, engine.new_generator(9)) for _ in range(2)]
    pieces: list[list[np.ndarray]] = [[], []]
    for i in range(0, 48, 7):
        for s, (stream, t) in enumerate(zip(streams, (first, second))):
            pieces[s].extend(stream.push(t[i:i + 7]))
    for s, stream in enumerate(streams):
        pieces[s].append(stream.finish())
    for s in range(2):
        assert np.array_equal(np.concatenate(pieces[s]), alone[s])
    after = (prompt.encoder.lower, prompt.estimator.kv, prompt.estimator.conv)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # streams never write into the voice's cache


def test_batched_chunks_equal_single_chunks(engine: DiTToken2Wav, prompt) -> None:
    other = engine.prompt_cache(*voice(1))
    lists = [tokens(50, seed=4), tokens(33, seed=5)]
    alone = [np.concatenate(run_stream(engine, p, t, seed=2, step=len(t))) for p, t in zip((prompt, other), lists)]
    streams = [engine.open_stream(p, engine.new_generator(2)) for p in (prompt, other)]
    for stream, t in zip(streams, lists):
        stream.extend(t)
    pieces: list[list[np.ndarray]] = [[], []]
    while not all(s.finished for s in streams):
        work = [(s, c) for s in streams if (c := s.next_chunk(finished=True)) is not None]
        for (stream, _), audio in zip(work, engine.run_chunks(work)):
            pieces[streams.index(stream)].append(audio)
    for s in range(2):
        assert np.abs(np.concatenate(pieces[s]) - alone[s]).max() < 5e-3  # batched HiFT rounds differently


def test_estimator_window_is_bounded_and_encoder_cache_grows(engine: DiTToken2Wav, prompt) -> None:
    stream = engine.open_stream(prompt, engine.new_generator(0))
    stream.extend(tokens(250, seed=6))
    windows, encoder_tokens = [], []
    while (chunk := stream.next_chunk(finished=False)) is not None:
        engine.run_chunks([(stream, chunk)])
        windows.append(stream.flow_state.estimator.frames)
        encoder_tokens.append(stream.flow_state.encoder.tokens)
    limit = 2 * PROMPT_TOKENS + engine.flow.config.solver.window_extra_frames
    assert max(windows) == limit and windows[0] < limit
    assert encoder_tokens == sorted(encoder_tokens) and encoder_tokens[-1] == PROMPT_TOKENS + stream.chunks[-1].stop


def test_empty_and_tail_only_finals(engine: DiTToken2Wav, prompt) -> None:
    empty = engine.open_stream(prompt, engine.new_generator(0))
    assert empty.finish().size == 0
    stream = engine.open_stream(prompt, engine.new_generator(0))
    pieces = stream.push(tokens(18, seed=7))  # exactly one chunk: hop 15 + 3 lookahead
    assert len(pieces) == 1
    assert stream.next_chunk(finished=True) == Chunk(15, 18, 18, final=True)
    pieces.append(stream.finish())
    assert sum(len(p) for p in pieces) == 960 * 18
    with pytest.raises(RuntimeError):
        stream.push([1])


def test_bad_tokens_leave_the_stream_unchanged(engine: DiTToken2Wav, prompt) -> None:
    stream = engine.open_stream(prompt, engine.new_generator(0))
    stream.extend(tokens(10) + [6561] + tokens(10))
    state = stream.generator.get_state()
    chunk = stream.next_chunk(finished=False)
    with pytest.raises(ValueError, match="speech tokens must be in 0..6560"):
        engine.run_chunks([(stream, chunk)])
    assert stream.chunks == [] and torch.equal(stream.generator.get_state(), state)
    with pytest.raises(ValueError, match="does not continue"):
        engine.run_chunks([(stream, Chunk(3, 18, 21, final=False))])


def test_offline_length_and_seed(engine: DiTToken2Wav) -> None:
    generated = tokens(40, seed=8)
    first = engine.offline(generated, *voice(0), engine.new_generator(4))
    again = engine.offline(generated, *voice(0), engine.new_generator(4))
    assert first.shape == (960 * 40,) and np.array_equal(first, again)
    assert np.isfinite(first).all() and np.abs(first).max() > 1e-3


def test_voice_caches_compute_once_and_evict() -> None:
    caches = VoiceCaches(capacity=2)
    calls: list[str] = []

    def compute(key: str):
        calls.append(key)
        return key  # any object stands in for a PromptCache here

    for key in ("a", "b", "a", "c", "b", "a"):
        assert caches.get(key, lambda key=key: compute(key)) == key
    assert calls == ["a", "b", "c", "b", "a"] and len(caches) == 2


def test_flow_batch_of_ragged_streams_equals_each_alone(engine: DiTToken2Wav) -> None:
    """Different prompt lengths (cached K/V 40 vs 24 frames) and chunk lengths (18 vs 9 tokens, one final)."""
    rng = np.random.default_rng(11)
    short = engine.prompt_cache(rng.integers(0, 6561, 12), rng.standard_normal((24, 80)).astype(np.float32) - 5,
                                rng.standard_normal(192).astype(np.float32))
    long = engine.prompt_cache(*voice(2))
    from cosyvoice2.dit.flow import FlowState

    states = [FlowState.start(long), FlowState.start(short)]
    chunk_tokens = [torch.tensor([tokens(18, seed=12)]), torch.tensor([tokens(9, seed=13)])]
    lasts = [False, True]
    batched = engine.flow.chunks(chunk_tokens, states, lasts)
    for i in range(2):
        mu, mel, state = engine.flow.chunk(chunk_tokens[i], states[i], lasts[i])
        b_mu, b_mel, b_state = batched[i]
        assert b_mel.shape == mel.shape == (1, 80, (30, 18)[i])
        assert (b_mel - mel).abs().max() < 1e-4
        assert b_state.estimator.kv.shape == state.estimator.kv.shape
        assert (b_state.estimator.kv - state.estimator.kv).abs().max() < 1e-4
        assert (b_state.estimator.conv - state.estimator.conv).abs().max() < 1e-4


def test_schedule_chunks_cover_every_token() -> None:
    from cosyvoice2.dit.token2wav import DiTChunkSchedule

    schedule = DiTChunkSchedule()
    assert schedule.chunks(104) == [Chunk(0, 15, 18, False), Chunk(15, 40, 43, False), Chunk(40, 90, 93, False),
                                    Chunk(90, 104, 104, True)]  # the reference runtime's chunks for 104 tokens
    assert schedule.chunks(17) == [Chunk(0, 17, 17, True)]
    assert schedule.next_chunk(0, 0, 17, finished=False) is None


def test_offline_job_is_one_final_chunk(engine: DiTToken2Wav, prompt) -> None:
    generated = tokens(30, seed=9)
    stream, chunk = engine.offline_job(generated, prompt, engine.new_generator(1))
    assert chunk == Chunk(0, 30, 30, final=True)
    (audio,) = engine.run_chunks([(stream, chunk)])
    assert audio.shape == (960 * 30,) and stream.finished
    # a stream whose first hop exceeds the utterance also runs it as one final chunk
    long_hops = DiTToken2Wav(engine.flow, engine.hift, DiTStreamingConfig(first_hops=(40,), max_hop=40))
    alone = long_hops.open_stream(prompt, engine.new_generator(1))
    alone.extend(generated)
    assert np.array_equal(alone.finish(), audio)


def test_prompt_cache_from_a_voice_prompt(engine: DiTToken2Wav, tiny_prompt) -> None:
    """The CosyVoice2 frontend's VoicePrompt (tokens, 24 kHz mel, x-vector) is the DiT's prompt as well."""
    caches = VoiceCaches()
    cache = caches.get(tiny_prompt.content_hash, lambda: engine.prompt_cache(
        tiny_prompt.speech_tokens, tiny_prompt.prompt_mel, tiny_prompt.xvector))
    assert cache.prompt_frames == 2 * len(tiny_prompt.speech_tokens)
    assert caches.get(tiny_prompt.content_hash, lambda: pytest.fail("computed twice")) is cache
    stream = engine.open_stream(cache, engine.new_generator(0))
    audio = np.concatenate(stream.push(tokens(20, seed=14)) + [stream.finish()])
    assert audio.shape == (960 * 20,) and np.isfinite(audio).all()


def test_prompt_tokens_and_mel_are_aligned_to_the_shorter(engine: DiTToken2Wav) -> None:
    prompt_tokens, mel, xvector = voice(4)
    cache = engine.prompt_cache(prompt_tokens, mel[:31], xvector)  # 31 frames: 15 tokens' worth
    assert cache.prompt_frames == 30 and cache.encoder.tokens == 15


def test_a_stream_beyond_the_position_table_gets_a_clear_error() -> None:
    from cosyvoice2.dit.config import DiTEncoderConfig
    from cosyvoice2.dit.encoder import UpsampleConformerEncoderV2

    encoder = UpsampleConformerEncoderV2(DiTEncoderConfig(width=16, attention_heads=2, linear_units=32, num_blocks=1,
                                                          num_up_blocks=1, max_positions=39))
    torch.nn.init.zeros_(encoder.encoders[0].self_attn.pos_bias_u)
    torch.nn.init.zeros_(encoder.encoders[0].self_attn.pos_bias_v)
    torch.nn.init.zeros_(encoder.up_encoders[0].self_attn.pos_bias_u)
    torch.nn.init.zeros_(encoder.up_encoders[0].self_attn.pos_bias_v)
    with torch.inference_mode():
        _, cache = encoder.forward_chunk(torch.randn(1, 18, 16), None, last=False)  # 15 tokens, 30 frames
        with pytest.raises(ValueError, match="too long"):
            encoder.forward_chunk(torch.randn(1, 8, 16), cache, last=False)  # upper layers: 30 + 10 = 40 frames > 39


def test_prompt_key_follows_the_features() -> None:
    from cosyvoice2.dit.token2wav import prompt_key

    prompt_tokens, mel, xvector = voice(5)
    key = prompt_key(prompt_tokens, mel, xvector)
    assert key == prompt_key(prompt_tokens.tolist(), mel.copy(), xvector.copy())
    changed = mel.copy()
    changed[3, 7] += 1e-3
    assert len({key, prompt_key(prompt_tokens, changed, xvector), prompt_key(prompt_tokens[:-1], mel[:-2], xvector),
                prompt_key(prompt_tokens, mel, -xvector)}) == 4
