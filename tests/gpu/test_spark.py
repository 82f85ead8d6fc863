"""The Spark-TTS engine on CUDA: the LLM's step graphs (the shared `BatchedDecoder`, driving Spark's Qwen2) replay
the eager steps, batched vocoding of windows of different lengths equals vocoding each alone, and streamed audio
equals offline audio. The tiny model checks these fast; the released size (marked slow) runs the real shapes with
the LLM in bf16, as served. benchmarks/enginebench/spark_engine.py times the same engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speech_lm.decode import BatchedDecoder
from spark_tts.engine import SparkTTS
from spark_tts.llm import SparkSampling, spark_request
from spark_tts.testing import write_full_size_random_model, write_tiny_model

STREAM_ATOL = 1e-3  # streamed windows run other conv shapes than the offline pass; fp32, TF32 off
SAMPLES_PER_CODE = 320  # 16 kHz / 50 codes per second
TEXT = "A sentence long enough for a few streamed pieces."


@pytest.fixture(scope="module")
def tiny(gpus, no_tf32, tmp_path_factory) -> SparkTTS:
    torch.set_grad_enabled(False)
    return SparkTTS.load(write_tiny_model(tmp_path_factory.mktemp("spark_tiny"), seed=0), device="cuda")


def reference_wav(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * (140 + 30 * seed) * t) + 0.03 * rng.standard_normal(t.size)).astype(np.float32)


@torch.inference_mode()
def decoded(engine: SparkTTS, prompts: list[list[int]], tokens: int, graphs: bool) -> list[list[int]]:
    """Every prompt decoded together on one decoder for exactly `tokens` tokens."""
    decoder = BatchedDecoder(engine.lm, num_slots=len(prompts), max_seq_len=max(map(len, prompts)) + tokens + 1,
                             cuda_graphs=graphs)
    sampling = SparkSampling(max_new_tokens=tokens)
    slots = decoder.add_many([spark_request(p, sampling, seed=i, ignore_eos=True) for i, p in enumerate(prompts)])
    out: dict[int, list[int]] = {slot: [] for slot in slots}
    while decoder.active_slots:
        for slot, step in decoder.step().items():
            if step.token is not None:
                out[slot].append(step.token)
    return [out[slot] for slot in slots]


def assert_step_graphs_replay_eager_steps(engine: SparkTTS, voice, tokens: int) -> None:
    prompts = [engine.prompt_ids(voice, text) for text in ("Hi.", TEXT, "Another one.")]
    eager = decoded(engine, prompts, tokens, graphs=False)
    assert [len(t) for t in eager] == [tokens] * len(prompts)
    assert decoded(engine, prompts, tokens, graphs=True) == eager


def assert_stream_equals_offline(engine: SparkTTS, voice, codes: int) -> None:
    engine.set_fixed_token_count(codes)
    try:
        offline = engine.synthesize(voice, TEXT, seed=2)
        pieces = list(engine.stream(voice, TEXT, seed=2))
    finally:
        engine.set_fixed_token_count(None)
    assert offline.size == codes * SAMPLES_PER_CODE and len(pieces) >= 2
    assert np.isfinite(offline).all()
    assert np.abs(np.concatenate(pieces) - offline).max() <= STREAM_ATOL


def test_tiny_step_graphs_replay_the_eager_steps(tiny: SparkTTS) -> None:
    [voice] = tiny.prepare_voices([reference_wav(1.0, 0)], ["Hello world."])
    assert_step_graphs_replay_eager_steps(tiny, voice, tokens=40)


def test_tiny_batched_vocoding_equals_solo_vocoding(tiny: SparkTTS) -> None:
    [voice] = tiny.prepare_voices([reference_wav(1.0, 0)], ["Hello world."])
    rng = np.random.default_rng(3)
    items = [(voice.global_tokens, rng.integers(0, 8192, n).tolist()) for n in (17, 60, 0, 33)]
    for (globals_, codes), wave in zip(items, tiny.vocode_batch(items), strict=True):
        solo = tiny.vocode(globals_, codes)
        assert wave.shape == solo.shape == (len(codes) * SAMPLES_PER_CODE,)
        assert len(codes) == 0 or np.abs(wave - solo).max() <= STREAM_ATOL


def test_tiny_stream_equals_offline(tiny: SparkTTS) -> None:
    [voice] = tiny.prepare_voices([reference_wav(1.0, 0)], ["Hello world."])
    assert_stream_equals_offline(tiny, voice, codes=120)


@pytest.mark.slow
def test_released_size_decodes_and_streams(gpus, no_tf32, tmp_path) -> None:
    torch.set_grad_enabled(False)
    engine = SparkTTS.load(write_full_size_random_model(tmp_path / "spark"), device="cuda", llm_dtype=torch.bfloat16)
    [voice] = engine.prepare_voices([reference_wav(3.0, 0)], ["A transcript of the reference audio."])
    assert len(voice.global_tokens) == 32
    assert_step_graphs_replay_eager_steps(engine, voice, tokens=60)
    assert_stream_equals_offline(engine, voice, codes=150)
