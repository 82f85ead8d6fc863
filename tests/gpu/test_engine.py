"""The CosyVoice2 engine at the released size on CUDA (random weights, bf16, every graph on): offline synthesis and
streaming of a fixed number of speech tokens give the samples those tokens stand for, all finite, and the stages
(LLM tokens, flow mel, HiFT audio) agree on the length. Random weights never stop sensibly, so the token count is
fixed (benchmark mode). benchmarks/enginebench/cosyvoice2_engine.py times the same calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cosyvoice2
from cosyvoice2.testing import write_full_size_random_model

TOKENS = 100  # 4 s of audio
SAMPLES_PER_TOKEN = 960  # 24 kHz / 25 tokens per second
TEXT = "This sentence only sets the text length; benchmark mode fixes the number of speech tokens."


def prompt_wav(seconds: float, sample_rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + 0.1 * t))).astype(np.float32)


@pytest.mark.slow
def test_the_released_size_engine_synthesizes_and_streams(gpus, tmp_path) -> None:
    model_dir = write_full_size_random_model(tmp_path / "model", torch.bfloat16)
    tts = cosyvoice2.load(model_dir, device="cuda", dtype=torch.bfloat16)
    prompt = tts.prepare_voice(prompt_wav(3.0), 16000, "A prompt transcript.")
    (segment,) = tts.segments(TEXT)
    tts.set_fixed_token_count(TOKENS)
    engine = tts.token2wav_engine
    tokens = list(tts.speech_tokens(segment, prompt, seed=0))
    assert len(tokens) == TOKENS and all(0 <= t < 6561 for t in tokens)
    with torch.inference_mode():
        mel = engine.mel(tokens, engine.flow_prompt(prompt), 0, final=True)
        audio, _ = engine.vocode(mel, None, engine.new_generator(0))
    assert audio.shape[0] == TOKENS * SAMPLES_PER_TOKEN
    offline = tts.synthesize(TEXT, prompt, seed=1)
    streamed = list(tts.stream(TEXT, prompt, seed=1))
    assert len(streamed) >= 2
    assert len(offline) == sum(len(chunk) for chunk in streamed) == TOKENS * SAMPLES_PER_TOKEN
    assert np.isfinite(offline).all() and all(np.isfinite(chunk).all() for chunk in streamed)
