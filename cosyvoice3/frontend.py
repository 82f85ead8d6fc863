"""The CosyVoice3 prompt frontend: a reference recording -> `VoicePrompt` (speech tokens, prompt mel, x-vector).

The maths is CosyVoice2's (`cosyvoice2.frontend`), with two differences:

- speech tokens come from `speech_tokenizer_v3.onnx` (CosyVoice2 uses v2). Its interface is the same: a Whisper
  128-bin log-mel of the 16 kHz audio in, 25 tokens per second (ids 0..6560) out, at most 30 s of audio;
- the prompt mel (24 kHz, 80 bins, n_fft 1920, hop 480, 50 frames per second, no centring) spans the whole band
  up to the Nyquist frequency, 12 kHz (CosyVoice2 stops at 8 kHz).

The x-vector is CAM++ (`campplus.onnx`) on the mean-normalised 80-bin Kaldi fbank of the 16 kHz audio, as in
CosyVoice2. Tokens and mel are trimmed to exactly 2 mel frames per token (the flow relies on it). The prompt is
computed once per voice; every mode feeds it to the flow, zero-shot mode also to the LLM.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cosyvoice2.frontend.audio import load_audio
from cosyvoice2.frontend.features import MEL_SAMPLE_RATE
from cosyvoice2.frontend.onnx_models import PromptModels
from cosyvoice2.frontend.prompt import PromptAudioError, build_voice_prompt

from .errors import CosyVoice3InputError
from .layout import SPEECH_TOKENIZER_FILE
from .token2wav import VoicePrompt

#: The prompt mel's top filter edge: the Nyquist frequency of its 24 kHz audio.
PROMPT_MEL_FMAX = MEL_SAMPLE_RATE / 2
#: Speech tokens per second of the v3 tokenizer, and prompt mel frames per token.
TOKEN_RATE = 25
TOKEN_MEL_RATIO = 2


class PromptFrontend:
    """Reference audio -> `VoicePrompt` with the release's two ONNX models (run by onnxruntime)."""

    def __init__(self, models: PromptModels) -> None:
        self.models = models

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, providers: list[str] | None = None) -> "PromptFrontend":
        """`campplus.onnx` (CPU) and `speech_tokenizer_v3.onnx` (`providers`, default CUDA when available)."""
        return cls(PromptModels.from_model_dir(model_dir, providers, speech_tokenizer_file=SPEECH_TOKENIZER_FILE))

    def voice(self, wav: np.ndarray, sample_rate: int) -> VoicePrompt:
        """Mono float waveform in [-1, 1] at any rate >= 16 kHz, at most 30 s."""
        try:
            prompt = build_voice_prompt(wav, sample_rate, "", self.models, mel_fmax=PROMPT_MEL_FMAX)
        except PromptAudioError as exc:
            raise CosyVoice3InputError(str(exc)) from exc
        return VoicePrompt.from_arrays(prompt.speech_tokens, prompt.prompt_mel, prompt.xvector)

    def voice_from_file(self, path: str | Path) -> VoicePrompt:
        wav, sample_rate = load_audio(path)
        return self.voice(wav, sample_rate)


__all__ = ["PROMPT_MEL_FMAX", "PromptFrontend", "TOKEN_MEL_RATIO", "TOKEN_RATE"]
