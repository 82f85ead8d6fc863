"""Voice prompt: everything CosyVoice2 needs from a reference recording, computed once and storable.

`build_voice_prompt` follows upstream's zero-shot frontend (docs/reference/cosyvoice2.md#frontend): from the
original waveform it resamples once to 16 kHz (speech tokens and x-vector) and once to 24 kHz (prompt mel), then
trims tokens and mel to an exact 1:2 ratio.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from .audio import MIN_PROMPT_SAMPLE_RATE, load_audio, resample
from .features import (MEL_FMAX, MEL_N_MELS, MEL_SAMPLE_RATE, WHISPER_SAMPLE_RATE, matcha_mel, speaker_fbank,
                       whisper_log_mel)
from .onnx_models import PromptModels

MAX_PROMPT_SECONDS = 30.0
MIN_PROMPT_SECONDS = 1 / 25  # one speech token
TOKEN_MEL_RATIO = 2
XVECTOR_DIM = 192
_FORMAT = "cosyvoice2-voice-prompt/1"


class PromptAudioError(ValueError):
    """The prompt recording cannot be used (rate, length)."""


@dataclass(frozen=True, eq=False)
class VoicePrompt:
    speech_tokens: np.ndarray  # (P,) int32, 25 Hz
    prompt_mel: np.ndarray  # (2P, 80) float32, 50 Hz, natural-log mel
    xvector: np.ndarray  # (192,) float32 CAM++ speaker embedding
    transcript: str  # what is said in the recording

    def __post_init__(self) -> None:
        tokens, mel, xvector = self.speech_tokens, self.prompt_mel, self.xvector
        if tokens.ndim != 1 or tokens.dtype != np.int32:
            raise ValueError(f"speech_tokens must be 1-D int32, got {tokens.dtype} {tokens.shape}")
        if mel.dtype != np.float32 or mel.shape != (TOKEN_MEL_RATIO * len(tokens), MEL_N_MELS):
            raise ValueError(f"prompt_mel must be float32 ({TOKEN_MEL_RATIO * len(tokens)}, {MEL_N_MELS}) "
                             f"for {len(tokens)} tokens, got {mel.dtype} {mel.shape}")
        if xvector.dtype != np.float32 or xvector.shape != (XVECTOR_DIM,):
            raise ValueError(f"xvector must be float32 ({XVECTOR_DIM},), got {xvector.dtype} {xvector.shape}")

    @property
    def content_hash(self) -> str:
        """sha256 over transcript, shapes and array bytes: equal prompts have equal hashes."""
        digest = hashlib.sha256()
        header = {"transcript": self.transcript, "tokens": len(self.speech_tokens)}
        digest.update(json.dumps(header, ensure_ascii=False, sort_keys=True).encode())
        for array in (self.speech_tokens, self.prompt_mel, self.xvector):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write a safetensors file; the transcript and the content hash go into its metadata."""
        path = Path(path)
        save_file({"speech_tokens": self.speech_tokens, "prompt_mel": self.prompt_mel, "xvector": self.xvector},
                  str(path), metadata={"format": _FORMAT, "transcript": self.transcript,
                                       "content_hash": self.content_hash})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "VoicePrompt":
        """Read a file written by `save`; raises ValueError if its content does not match its hash."""
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise ValueError(f"{path}: not a voice prompt file (format {metadata.get('format')!r})")
            prompt = cls(f.get_tensor("speech_tokens"), f.get_tensor("prompt_mel"), f.get_tensor("xvector"),
                         metadata["transcript"])
        if prompt.content_hash != metadata.get("content_hash"):
            raise ValueError(f"{path}: content hash mismatch (file corrupted or edited)")
        return prompt


def align_tokens_and_mel(tokens: np.ndarray, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Trim to P = min(T_mel // 2, T_tok) tokens and exactly 2P mel frames (the flow relies on 1:2)."""
    count = min(mel.shape[0] // TOKEN_MEL_RATIO, tokens.shape[0])
    return tokens[:count], mel[:TOKEN_MEL_RATIO * count]


@torch.inference_mode()
def build_voice_prompt(wav: np.ndarray, sample_rate: int, transcript: str, models: PromptModels,
                       mel_fmax: float = MEL_FMAX) -> VoicePrompt:
    """Mono float waveform in [-1, 1] at any rate >= 16 kHz, at most 30 s -> VoicePrompt. `mel_fmax`: the prompt
    mel's top filter edge (CosyVoice3 passes 12 kHz)."""
    if sample_rate < MIN_PROMPT_SAMPLE_RATE:
        raise PromptAudioError(f"prompt audio sample rate {sample_rate} Hz is below {MIN_PROMPT_SAMPLE_RATE} Hz")
    samples = torch.as_tensor(np.asarray(wav, dtype=np.float32).reshape(-1))
    seconds = samples.numel() / sample_rate
    if seconds > MAX_PROMPT_SECONDS:
        raise PromptAudioError(f"prompt audio is {seconds:.1f} s long; at most {MAX_PROMPT_SECONDS:.0f} s is supported")
    if seconds < MIN_PROMPT_SECONDS:  # below one token's span the feature padding would fail, not just give none
        raise PromptAudioError(f"prompt audio is too short ({seconds:.2f} s) to give any speech token")
    wav_16k = resample(samples, sample_rate, WHISPER_SAMPLE_RATE)
    tokens = models.speech_tokenizer(whisper_log_mel(wav_16k).numpy())
    xvector = models.speaker_encoder(speaker_fbank(wav_16k).numpy())
    mel = matcha_mel(resample(samples, sample_rate, MEL_SAMPLE_RATE), mel_fmax).numpy()
    tokens, mel = align_tokens_and_mel(tokens, mel)
    if len(tokens) == 0:
        raise PromptAudioError(f"prompt audio is too short ({seconds:.2f} s) to give any speech token")
    return VoicePrompt(np.ascontiguousarray(tokens, dtype=np.int32), np.ascontiguousarray(mel, dtype=np.float32),
                       xvector.astype(np.float32), transcript)


def build_voice_prompt_from_file(path: str | Path, transcript: str, models: PromptModels) -> VoicePrompt:
    wav, sample_rate = load_audio(path)
    return build_voice_prompt(wav, sample_rate, transcript, models)
