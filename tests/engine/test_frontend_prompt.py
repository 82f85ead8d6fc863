"""Voice prompt building (tiny ONNX stand-ins), trimming, storage, audio loading and the ONNX interfaces."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import soundfile
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from cosyvoice2.frontend.audio import load_audio, resample
from cosyvoice2.frontend.features import matcha_mel
from cosyvoice2.frontend.onnx_models import PromptModels, default_providers
from cosyvoice2.frontend.prompt import (
    PromptAudioError,
    VoicePrompt,
    align_tokens_and_mel,
    build_voice_prompt,
    build_voice_prompt_from_file,
)
from cosyvoice2.testing.frontend_models import write_tiny_frontend_models

ZERO_SHOT_TRANSCRIPT = "希望你以后能够做的比我还好呦。"
#: Optional real recordings (upstream CosyVoice's ``asset/`` prompts: zero_shot_prompt.wav, cross_lingual_prompt.wav)
#: for the extra real-speech variants; they are not part of the repository, so those variants run only when
#: COSYVOICE_SPEECH_SAMPLES names a directory holding them (the generated variants always run).
SPEECH_SAMPLES = Path(os.environ["COSYVOICE_SPEECH_SAMPLES"]) if os.environ.get("COSYVOICE_SPEECH_SAMPLES") else None
SAMPLE_VARIANTS = ["generated", "real"] if SPEECH_SAMPLES is not None else ["generated"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> PromptModels:
    model_dir = tmp_path_factory.mktemp("frontend_models")
    write_tiny_frontend_models(model_dir)
    return PromptModels.from_model_dir(model_dir, providers=["CPUExecutionProvider"])


def speech_like(seconds: float, sample_rate: int, seed: int = 0) -> np.ndarray:
    """A voiced, syllable-paced signal: harmonics of a gliding 100-250 Hz pitch under a 4 Hz envelope, plus a
    little noise (so every mel band has energy), peaking near -3 dBFS as recorded speech does."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * sample_rate)) / sample_rate
    pitch = 175 + 75 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 25) if k * 250 < sample_rate / 2)
    envelope = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 0.5
    wav = envelope * voiced + 0.02 * rng.standard_normal(len(t))
    return (0.7 * wav / np.abs(wav).max()).astype(np.float32)


def wav_format_tag(path: Path) -> int:
    """The fmt chunk's format tag of a canonical RIFF/WAVE file (1 PCM, 3 IEEE float)."""
    header = path.read_bytes()[:36]
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    return int.from_bytes(header[20:22], "little")


@pytest.fixture(params=SAMPLE_VARIANTS, scope="module")
def zero_shot_wav(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 kHz mono 32-bit float WAV (format tag 3, which Python's `wave` module cannot read), 3.5 s."""
    if request.param == "real":
        return require(SPEECH_SAMPLES / "zero_shot_prompt.wav")
    path = tmp_path_factory.mktemp("speech") / "zero_shot_prompt.wav"
    soundfile.write(path, speech_like(3.5, 24000), 24000, subtype="FLOAT", format="WAV")
    assert wav_format_tag(path) == 3
    return path


@pytest.fixture(params=SAMPLE_VARIANTS, scope="module")
def cross_lingual_wav(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """22.05 kHz mono 16-bit PCM WAV, 13.7 s: a rate that is a multiple of neither 16 kHz nor 24 kHz."""
    if request.param == "real":
        return require(SPEECH_SAMPLES / "cross_lingual_prompt.wav")
    path = tmp_path_factory.mktemp("speech") / "cross_lingual_prompt.wav"
    soundfile.write(path, speech_like(13.7, 22050, seed=1), 22050, subtype="PCM_16", format="WAV")
    assert wav_format_tag(path) == 1
    return path


def require(path: Path) -> Path:
    if not path.exists():  # asked for by COSYVOICE_SPEECH_SAMPLES, so missing is an error, not a skip
        raise FileNotFoundError(f"COSYVOICE_SPEECH_SAMPLES has no {path.name}: {path}")
    return path


def random_prompt(tokens: int = 10, transcript: str = "hello") -> VoicePrompt:
    rng = np.random.default_rng(tokens)
    return VoicePrompt(rng.integers(0, 6561, tokens).astype(np.int32),
                       rng.standard_normal((2 * tokens, 80)).astype(np.float32),
                       rng.standard_normal(192).astype(np.float32), transcript)


# ---- ONNX stand-ins have the released interfaces ---------------------------------------------------------------
def test_stand_in_interfaces(models: PromptModels) -> None:
    campplus, tokenizer = models.speaker_encoder.session, models.speech_tokenizer.session
    assert [(i.name, len(i.shape)) for i in campplus.get_inputs()] == [("input", 3)]
    assert [len(o.shape) for o in campplus.get_outputs()] == [2]
    assert [(i.name, i.type) for i in tokenizer.get_inputs()] == [("feats", "tensor(float)"),
                                                                  ("feats_length", "tensor(int32)")]
    assert [(o.name, len(o.shape)) for o in tokenizer.get_outputs()] == [("indices", 2)]


@pytest.mark.parametrize("frames", [1, 4, 5, 103])
def test_tokenizer_gives_25_hz_tokens(models: PromptModels, frames: int) -> None:
    tokens = models.speech_tokenizer(np.random.default_rng(0).standard_normal((128, frames)))
    assert tokens.dtype == np.int32 and tokens.shape == (math.ceil(frames / 4),)
    assert ((tokens >= 0) & (tokens < 6561)).all()


def test_speaker_encoder_output(models: PromptModels) -> None:
    fbank = np.random.default_rng(0).standard_normal((50, 80)).astype(np.float32)
    xvector = models.speaker_encoder(fbank)
    assert xvector.shape == (192,) and xvector.dtype == np.float32
    assert not np.allclose(xvector, models.speaker_encoder(fbank + 1.0))


# ---- trimming and VoicePrompt ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mel_frames, token_count, expected", [(175, 90, 87), (100, 40, 40), (81, 41, 40), (1, 3, 0)])
def test_align_tokens_and_mel(mel_frames: int, token_count: int, expected: int) -> None:
    tokens, mel = align_tokens_and_mel(np.arange(token_count, dtype=np.int32), np.zeros((mel_frames, 80)))
    assert len(tokens) == expected and mel.shape[0] == 2 * expected
    assert tokens.tolist() == list(range(expected))  # the head is kept


def test_voice_prompt_round_trip(tmp_path: Path) -> None:
    prompt = random_prompt(12, ZERO_SHOT_TRANSCRIPT)
    loaded = VoicePrompt.load(prompt.save(tmp_path / "voice.safetensors"))
    assert loaded.transcript == ZERO_SHOT_TRANSCRIPT
    for name in ("speech_tokens", "prompt_mel", "xvector"):
        assert np.array_equal(getattr(loaded, name), getattr(prompt, name))
        assert getattr(loaded, name).dtype == getattr(prompt, name).dtype
    assert loaded.content_hash == prompt.content_hash


def test_content_hash_depends_on_content() -> None:
    base = random_prompt(8, "a")
    assert random_prompt(8, "a").content_hash == base.content_hash
    assert random_prompt(8, "b").content_hash != base.content_hash
    changed = VoicePrompt(base.speech_tokens, base.prompt_mel, base.xvector + 1e-3, "a")
    assert changed.content_hash != base.content_hash


def test_load_rejects_tampered_file(tmp_path: Path) -> None:
    prompt = random_prompt(6)
    path = prompt.save(tmp_path / "voice.safetensors")
    with safe_open(str(path), framework="np") as f:
        metadata = f.metadata()
    save_file({"speech_tokens": prompt.speech_tokens, "prompt_mel": prompt.prompt_mel,
               "xvector": prompt.xvector * 2}, str(path), metadata=metadata)
    with pytest.raises(ValueError, match="hash"):
        VoicePrompt.load(path)


def test_voice_prompt_validates_shapes() -> None:
    good = random_prompt(5)
    with pytest.raises(ValueError, match="prompt_mel"):
        VoicePrompt(good.speech_tokens, good.prompt_mel[:9], good.xvector, "x")
    with pytest.raises(ValueError, match="speech_tokens"):
        VoicePrompt(good.speech_tokens.astype(np.int64), good.prompt_mel, good.xvector, "x")


# ---- building from audio -----------------------------------------------------------------------------------------
def test_rejects_low_rate_and_long_audio(models: PromptModels) -> None:
    with pytest.raises(PromptAudioError, match="16000"):
        build_voice_prompt(np.zeros(8000, np.float32), 8000, "x", models)
    with pytest.raises(PromptAudioError, match="30 s"):
        build_voice_prompt(np.zeros(16000 * 31, np.float32), 16000, "x", models)


def test_zero_shot_prompt_from_a_float_wav(models: PromptModels, zero_shot_wav: Path) -> None:
    wav, sample_rate = load_audio(zero_shot_wav)
    assert sample_rate == 24000
    prompt = build_voice_prompt_from_file(zero_shot_wav, ZERO_SHOT_TRANSCRIPT, models)
    seconds = len(wav) / sample_rate
    assert len(prompt.speech_tokens) == int(seconds * 25)  # 25 Hz tokens
    assert prompt.prompt_mel.shape == (2 * len(prompt.speech_tokens), 80)  # 50 Hz mel, exactly 2:1
    # at 24 kHz the prompt mel is taken from the file samples themselves (no resampling round trip)
    direct_mel = matcha_mel(torch.from_numpy(wav)).numpy()
    assert np.allclose(prompt.prompt_mel, direct_mel[: prompt.prompt_mel.shape[0]], atol=1e-5)
    # the tokens come from the 16 kHz version resampled from the original
    assert np.array_equal(prompt.speech_tokens,
                          build_voice_prompt(wav, sample_rate, "", models).speech_tokens)
    assert prompt.prompt_mel.max() > 0 and prompt.prompt_mel.min() >= math.log(1e-5) - 1e-6


def test_cross_lingual_prompt_at_22050(models: PromptModels, cross_lingual_wav: Path) -> None:
    wav, sample_rate = load_audio(cross_lingual_wav)
    assert sample_rate == 22050
    prompt = build_voice_prompt(wav, sample_rate, "", models)
    n_24k = math.ceil(len(wav) * 24000 / 22050)
    n_16k = math.ceil(len(wav) * 16000 / 22050)
    assert len(prompt.speech_tokens) == min(n_24k // 480 // 2, math.ceil(n_16k // 160 / 4))
    assert prompt.prompt_mel.shape == (2 * len(prompt.speech_tokens), 80)


# ---- audio loading --------------------------------------------------------------------------------------------------
def test_load_audio_mixes_channels_and_scales_pcm(tmp_path: Path) -> None:
    left = (np.sin(np.arange(4410) * 0.05) * 16000).astype(np.int16)
    right = np.full(4410, -8000, dtype=np.int16)
    soundfile.write(tmp_path / "stereo.flac", np.stack([left, right], axis=1), 44100, subtype="PCM_16")
    wav, sample_rate = load_audio(tmp_path / "stereo.flac")
    assert sample_rate == 44100 and wav.dtype == np.float32 and wav.shape == (4410,)
    assert np.allclose(wav, (left.astype(np.float32) + right) / 2 / 32768, atol=1e-7)


def test_load_audio_float_wav(tmp_path: Path) -> None:
    samples = np.linspace(-0.5, 0.5, 1000, dtype=np.float32)
    soundfile.write(tmp_path / "f.wav", samples, 16000, subtype="FLOAT")
    wav, _ = load_audio(tmp_path / "f.wav")
    assert np.array_equal(wav, samples)


def test_default_providers_include_cpu() -> None:
    providers = default_providers()
    assert providers[-1] == "CPUExecutionProvider"
    assert set(providers) <= set(ort.get_available_providers())


def test_resampled_16k_is_used_for_tokens(models: PromptModels) -> None:
    # same content at 48 kHz and 16 kHz must give (nearly) the same whisper input, hence mostly equal tokens
    t = np.arange(48000 * 2) / 48000
    wav_48k = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.5 * t)).astype(np.float32)
    wav_16k = resample(torch.from_numpy(wav_48k), 48000, 16000).numpy()
    a = build_voice_prompt(wav_48k, 48000, "", models)
    b = build_voice_prompt(wav_16k, 16000, "", models)
    assert np.array_equal(a.speech_tokens, b.speech_tokens)
    assert np.allclose(a.xvector, b.xvector, atol=1e-6)
