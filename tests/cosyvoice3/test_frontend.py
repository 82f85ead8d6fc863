"""CosyVoice3 prompt frontend on tiny random ONNX stand-ins: rates and shapes, the 12 kHz prompt mel, the v3
tokenizer file, errors. (The parity oracle holds no frontend inputs or outputs: its prompt features are given.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from cosyvoice2.frontend.audio import resample
from cosyvoice2.frontend.features import MEL_FMAX, matcha_mel
from cosyvoice2.frontend.onnx_models import PromptModels
from cosyvoice2.testing.frontend_models import write_tiny_frontend_models
from cosyvoice3.errors import CosyVoice3InputError
from cosyvoice3.frontend import PROMPT_MEL_FMAX, TOKEN_MEL_RATIO, TOKEN_RATE, PromptFrontend
from cosyvoice3.layout import SPEECH_TOKENIZER_FILE
from tests.engine.test_frontend_prompt import speech_like


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cv3_frontend")
    write_tiny_frontend_models(directory, speech_tokenizer_file=SPEECH_TOKENIZER_FILE)
    return directory


@pytest.fixture(scope="module")
def frontend(model_dir: Path) -> PromptFrontend:
    return PromptFrontend.from_model_dir(model_dir, providers=["CPUExecutionProvider"])


def test_reads_the_v3_tokenizer_file(model_dir: Path) -> None:
    assert SPEECH_TOKENIZER_FILE == "speech_tokenizer_v3.onnx"
    assert not (model_dir / "speech_tokenizer_v2.onnx").exists()  # the v2 name would not be found
    with pytest.raises(Exception):
        PromptModels.from_model_dir(model_dir, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("sample_rate", [16000, 24000, 44100, 48000])
def test_rates_and_shapes(frontend: PromptFrontend, sample_rate: int) -> None:
    seconds = 3.0
    voice = frontend.voice(speech_like(seconds, sample_rate), sample_rate)
    tokens = voice.tokens.numel()
    assert tokens == round(seconds * TOKEN_RATE)  # 25 tokens per second
    assert voice.mel.shape == (TOKEN_MEL_RATIO * tokens, 80)  # 50 mel frames per second, 2 per token
    assert voice.xvector.shape == (192,)
    assert voice.tokens.dtype == torch.int64 and voice.mel.dtype == torch.float32
    assert 0 <= int(voice.tokens.min()) and int(voice.tokens.max()) < 6561
    assert torch.isfinite(voice.mel).all() and torch.isfinite(voice.xvector).all()


def test_prompt_mel_spans_the_band_to_nyquist(frontend: PromptFrontend) -> None:
    """A 10 kHz tone lies above CosyVoice2's 8 kHz top edge: only the CosyVoice3 mel sees it, in its top bins."""
    rate = 24000
    t = np.arange(2 * rate) / rate
    tone = (0.5 * np.sin(2 * np.pi * 10000 * t)).astype(np.float32)
    voice = frontend.voice(tone, rate)
    frames = voice.mel.shape[0]
    expected = matcha_mel(torch.from_numpy(tone), PROMPT_MEL_FMAX)[:frames]
    torch.testing.assert_close(voice.mel, expected)
    cv2_mel = matcha_mel(torch.from_numpy(tone), MEL_FMAX)[:frames]
    assert PROMPT_MEL_FMAX == 12000
    assert int(voice.mel.mean(0).argmax()) >= 70 and float(voice.mel.mean(0).max()) > -2
    assert float(cv2_mel.max()) < float(voice.mel.max()) - 3  # 8 kHz filters hardly see the tone


def test_tokens_and_mel_come_from_the_16k_and_24k_audio(frontend: PromptFrontend) -> None:
    rate = 48000
    wav = speech_like(2.0, rate, seed=3)
    voice = frontend.voice(wav, rate)
    mel_24k = matcha_mel(resample(torch.from_numpy(wav), rate, 24000), PROMPT_MEL_FMAX)
    torch.testing.assert_close(voice.mel, mel_24k[:voice.mel.shape[0]])


def test_from_file_equals_from_array(frontend: PromptFrontend, tmp_path: Path) -> None:
    wav = speech_like(1.5, 22050, seed=1)
    path = tmp_path / "ref.wav"
    soundfile.write(path, wav, 22050, subtype="FLOAT")
    a, b = frontend.voice_from_file(path), frontend.voice(wav, 22050)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mel, b.mel) and torch.equal(a.xvector, b.xvector)


def test_bad_audio_is_an_engine_input_error(frontend: PromptFrontend) -> None:
    with pytest.raises(CosyVoice3InputError, match="sample rate"):
        frontend.voice(np.zeros(8000, np.float32), 8000)
    with pytest.raises(CosyVoice3InputError, match="30 s"):
        frontend.voice(np.zeros(16000 * 31, np.float32), 16000)
    with pytest.raises(CosyVoice3InputError, match="too short"):
        frontend.voice(np.zeros(100, np.float32), 16000)
