"""The tiny random model writer (no shared data needed): it loads strictly through the engine, and the engine's
properties hold on it: masked batching keeps every request's tokens, streamed audio equals offline, clear input
errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from spark_tts.engine import SparkTTS
from spark_tts.errors import SparkInputError
from spark_tts.llm import SparkSampling
from spark_tts.testing import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SparkTTS:
    torch.set_grad_enabled(False)
    return SparkTTS.load(write_tiny_model(tmp_path_factory.mktemp("spark_tiny"), seed=0))


def _wav(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * (140 + 30 * seed) * t) + 0.03 * rng.standard_normal(t.size)).astype(np.float32)


def test_writer_is_deterministic(tmp_path: Path) -> None:
    a, b = write_tiny_model(tmp_path / "a", seed=3), write_tiny_model(tmp_path / "b", seed=3)
    for name in ("BiCodec/model.safetensors", "LLM/model.safetensors", "LLM/tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (write_tiny_model(tmp_path / "c", seed=4) / "LLM/model.safetensors").read_bytes() != (
        a / "LLM/model.safetensors").read_bytes()


def test_batched_voices_equal_solo_voices(tiny: SparkTTS) -> None:
    wavs = [_wav(2.0, 0), _wav(0.9, 1), _wav(1.37, 2)]
    batch = tiny.prepare_voices(wavs, ["a", "b", "c"])
    for wav, voice in zip(wavs, batch):
        [solo] = tiny.prepare_voices([wav], ["x"])
        assert voice.semantic_tokens == solo.semantic_tokens and voice.global_tokens == solo.global_tokens
    assert [len(v.semantic_tokens) for v in batch] == [99, 44, 68]


def test_stream_equals_offline(tiny: SparkTTS) -> None:
    [voice] = tiny.prepare_voices([_wav(1.0, 0)], ["Hello world."])
    sampling = SparkSampling(max_new_tokens=120)
    codes = list(tiny.generate(voice, "Hi there!", seed=2, sampling=sampling))
    offline = tiny.vocode(voice.global_tokens, codes)
    pieces = list(tiny.stream(voice, "Hi there!", seed=2, sampling=sampling))
    assert offline.size == 320 * len(codes) > 0
    assert np.abs(np.concatenate(pieces) - offline).max() < 1e-4


def test_transcript_free_voice_prompt(tiny: SparkTTS) -> None:
    [voice] = tiny.prepare_voices([_wav(1.0, 0)], [None])
    text = tiny.tokenizer.tokenizer.decode(tiny.prompt_ids(voice, "Hi."), skip_special_tokens=False)
    assert text.endswith("<|end_global_token|>") and text.count("<|bicodec_global_") == 32
    assert "<|bicodec_semantic_" not in text


def test_bad_inputs_raise_clear_errors(tiny: SparkTTS) -> None:
    with pytest.raises(SparkInputError, match="at least"):
        tiny.prepare_voices([np.zeros(300, np.float32)], ["x"])
    with pytest.raises(SparkInputError, match="empty"):
        tiny.prepare_voices([np.zeros(0, np.float32)], ["x"])
    with pytest.raises(SparkInputError, match="NaN"):
        tiny.prepare_voices([np.full(8000, np.nan, np.float32)], ["x"])
    with pytest.raises(SparkInputError, match="one transcript"):
        tiny.prepare_voices([_wav(1.0, 0)], [])
    [voice] = tiny.prepare_voices([_wav(1.0, 0)], ["x"])
    with pytest.raises(SparkInputError, match="empty"):
        tiny.prompt_ids(voice, "")


def test_benchmark_mode_yields_exactly_the_fixed_count(tiny: SparkTTS) -> None:
    [voice] = tiny.prepare_voices([_wav(1.0, 0)], ["Hello world."])
    tiny.set_fixed_token_count(37)
    try:
        assert len(list(tiny.generate(voice, "Hi.", seed=1))) == 37
        assert tiny.synthesize(voice, "Hi.", seed=1).size == 37 * 320
    finally:
        tiny.set_fixed_token_count(None)
    assert tiny.codes_of(tiny.tokenizer.vocab.eos_id) == []


def test_gpu_bench_script_reports_every_measurement() -> None:
    """The speed script runs end to end (tiny model, CPU); its numbers are not asserted, its counts are."""
    import importlib

    module = importlib.import_module("enginebench.spark_engine")
    report = module.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--tokens", "30", "--concurrency", "2",
                          "--reference-seconds", "1", "--first-chunk-tokens", "10"])
    assert report["offline_c1"]["audio_s"] == report["stream_c1"]["audio_s"] == 30 / 50
    assert report["receptive_radius"] == 39 and report["prompt_tokens"] > 38 + 40
    assert set(report["concurrent_c2"]) == {"first_piece_p50_s", "first_piece_max_s", "wall_s", "rtf", "ms_per_step"}
