"""End-to-end CosyVoice2 on the tiny random model: offline/streaming lengths, seeds, segments, benchmark mode.

Length rule (offline, docs/reference/cosyvoice2.md#flow-inference-and-lengths): each text segment with N generated
speech tokens gives exactly
480 x 2 x N samples (the final flow call pads the 3-token lookahead, so every token gets its 2 mel frames);
a request's audio is the concatenation of its segments. Streaming yields the same total per segment.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

SAMPLES_PER_TOKEN = 480 * 2
SHORT_TEXT = "Hi there."
LONG_TEXT = " ".join(f"Sentence number {w} is here, and it keeps going for a while." for w in
                     ("one", "two", "three", "four"))


def test_offline_length_is_960_samples_per_generated_token(tiny_engine, tiny_prompt) -> None:
    (segment,) = tiny_engine.segments(SHORT_TEXT)
    tokens = list(tiny_engine.speech_tokens(segment, tiny_prompt, seed=3))
    audio = tiny_engine.synthesize(SHORT_TEXT, tiny_prompt, seed=3)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) == SAMPLES_PER_TOKEN * len(tokens)
    assert 0 < np.abs(audio).max() <= 0.99
    text_tokens = len(tiny_engine.tokenizer.encode(segment))
    assert 2 * text_tokens <= len(tokens) <= 20 * text_tokens


def test_seed_reproduces_and_differs(tiny_engine, tiny_prompt) -> None:
    first = tiny_engine.synthesize(SHORT_TEXT, tiny_prompt, seed=3)
    np.testing.assert_array_equal(first, tiny_engine.synthesize(SHORT_TEXT, tiny_prompt, seed=3))
    other = tiny_engine.synthesize(SHORT_TEXT, tiny_prompt, seed=4)
    assert len(other) != len(first) or not np.array_equal(other, first)


def test_stream_matches_offline_length_and_schedule(tiny_engine, tiny_prompt) -> None:
    (segment,) = tiny_engine.segments(SHORT_TEXT)
    n_tokens = len(list(tiny_engine.speech_tokens(segment, tiny_prompt, seed=3)))
    chunks = list(tiny_engine.stream(SHORT_TEXT, tiny_prompt, seed=3))
    assert sum(len(c) for c in chunks) == n_tokens * SAMPLES_PER_TOKEN
    assert n_tokens >= 78 and len(chunks) >= 3  # 75-token prompt: hops 25, 50 ... then the final chunk
    assert [len(c) for c in chunks[:2]] == [25 * SAMPLES_PER_TOKEN - 3840, 50 * SAMPLES_PER_TOKEN]


def test_stream_first_hop_is_configurable(tiny_engine, tiny_prompt) -> None:
    chunks = list(tiny_engine.stream(SHORT_TEXT, tiny_prompt, seed=3, first_hop=15))
    assert [len(c) for c in chunks[:2]] == [15 * SAMPLES_PER_TOKEN - 3840, 30 * SAMPLES_PER_TOKEN]


def test_benchmark_mode_fixes_tokens_per_segment(tiny_engine, tiny_prompt) -> None:
    segments = tiny_engine.segments(LONG_TEXT)
    assert len(segments) >= 2
    bias_before = tiny_engine.llm.llm_decoder.bias.detach().clone()
    tiny_engine.set_fixed_token_count(37)
    try:
        assert len(list(tiny_engine.speech_tokens(segments[0], tiny_prompt, seed=1))) == 37
        audio = tiny_engine.synthesize(LONG_TEXT, tiny_prompt, seed=1)
        assert len(audio) == 37 * SAMPLES_PER_TOKEN * len(segments)
        streamed = list(tiny_engine.stream(LONG_TEXT, tiny_prompt, seed=1))
        assert sum(len(c) for c in streamed) == len(audio)
    finally:
        tiny_engine.set_fixed_token_count(None)
    torch.testing.assert_close(tiny_engine.llm.llm_decoder.bias, bias_before, rtol=0, atol=0)
    with pytest.raises(ValueError):
        tiny_engine.set_fixed_token_count(0)


def test_segments_are_synthesized_in_order_with_the_same_prompt(tiny_engine, tiny_prompt) -> None:
    segments = tiny_engine.segments(LONG_TEXT)
    tiny_engine.set_fixed_token_count(30)
    try:
        whole = tiny_engine.synthesize(LONG_TEXT, tiny_prompt, seed=9)
        pieces = [tiny_engine.token2wav(list(tiny_engine.speech_tokens(s, tiny_prompt, seed=9 + i)), tiny_prompt,
                                        seed=9 + i) for i, s in enumerate(segments)]
    finally:
        tiny_engine.set_fixed_token_count(None)
    np.testing.assert_array_equal(whole, np.concatenate(pieces))


def test_empty_text_gives_empty_audio(tiny_engine, tiny_prompt) -> None:
    assert len(tiny_engine.synthesize("  ", tiny_prompt)) == 0
    assert list(tiny_engine.stream("...", tiny_prompt)) == []


def test_prepare_voice_gives_aligned_prompt(tiny_engine, tiny_prompt) -> None:
    assert len(tiny_prompt.speech_tokens) == 75  # 3 s at 25 Hz
    assert tiny_prompt.prompt_mel.shape == (150, 80)
    assert tiny_prompt.transcript == "Hello world."


def test_decode_request_follows_the_voice_mode(tiny_engine, tiny_prompt) -> None:
    """Zero-shot reads transcript + prompt speech; instruct reads the instruction and no prompt speech;
    cross-lingual (no transcript) reads neither (cosyvoice2.frontend.llm_prompt)."""
    from cosyvoice2.frontend.prompt import VoicePrompt

    tokenizer = tiny_engine.tokenizer
    zero_shot = tiny_engine.decode_request("Hi there.", tiny_prompt).prefix
    assert list(zero_shot.prompt_speech_tokens) == tiny_prompt.speech_tokens.tolist()
    assert list(zero_shot.prompt_text) == tokenizer.encode(tiny_prompt.transcript) != []
    instruct = tiny_engine.decode_request("Hi there.", tiny_prompt, instruction="Speak softly.").prefix
    assert list(instruct.prompt_text) == tokenizer.encode("Speak softly.<|endofprompt|>")
    assert list(instruct.prompt_speech_tokens) == [] and list(instruct.text) == list(zero_shot.text)
    silent = VoicePrompt(tiny_prompt.speech_tokens, tiny_prompt.prompt_mel, tiny_prompt.xvector, "")
    cross = tiny_engine.decode_request("Hi there.", silent).prefix
    assert list(cross.prompt_text) == [] and list(cross.prompt_speech_tokens) == []
