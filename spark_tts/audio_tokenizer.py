"""The audio tokenizer: reference waveforms -> (global tokens, semantic tokens), batched with a mask.

Per request (16 kHz float waveform, its valid samples only):
- semantic tokens: waveform normalised to zero mean / unit variance -> wav2vec2 mixed features (50 Hz) ->
  BiCodec encoder -> factorized VQ, one token per 320 samples (``Wav2Vec2Params.frames``);
- global tokens: the first ``ref_segment_length`` (96,000) samples, the waveform tiled first when shorter ->
  magnitude mel -> speaker encoder -> ``token_num`` (32) FSQ tokens.

No volume normalisation (the served runtime does not apply the CLI's). A batch of requests of any lengths gives
every request exactly its solo tokens: padded samples and frames are masked (``spark_tts.codec.wav2vec2``,
``spark_tts.codec.layers``), unlike the upstream runtime, whose shorter requests change when batched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from spark_tts.codec.bicodec import BiCodec
from spark_tts.codec.wav2vec2 import Wav2Vec2Features, normalize_waveform
from spark_tts.config import AudioParams
from spark_tts.errors import SparkInputError


@dataclass(frozen=True)
class AudioTokens:
    """One reference's tokens: ``global_tokens`` ``[token_num]`` and ``semantic_tokens`` ``[frames]`` (int64)."""

    global_tokens: torch.Tensor
    semantic_tokens: torch.Tensor


def reference_clip(wav: np.ndarray | torch.Tensor, length: int) -> torch.Tensor:
    """The speaker clip: the first ``length`` samples, the waveform tiled first when it is shorter."""
    wav = torch.as_tensor(wav, dtype=torch.float32).reshape(-1)
    if wav.numel() == 0:
        raise SparkInputError("reference audio is empty")
    if wav.numel() < length:
        wav = wav.repeat(length // wav.numel() + 1)
    return wav[:length]


class AudioTokenizer:
    def __init__(self, bicodec: BiCodec, wav2vec2: Wav2Vec2Features, audio: AudioParams) -> None:
        self.bicodec, self.wav2vec2, self.audio = bicodec, wav2vec2, audio
        self.min_samples = wav2vec2.params.min_samples

    @property
    def device(self) -> torch.device:
        return self.bicodec.quantizer.codebook.weight.device

    @torch.inference_mode()
    def global_tokens(self, wavs: Sequence[np.ndarray | torch.Tensor]) -> torch.Tensor:
        """``[B, token_num]`` for a batch of waveforms (their speaker clips all have the same length)."""
        clips = torch.stack([reference_clip(w, self.audio.ref_segment_length) for w in wavs]).to(self.device)
        return self.bicodec.global_tokens(clips)

    @torch.inference_mode()
    def features(self, wavs: Sequence[np.ndarray | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Mixed wav2vec2 features ``[B, T, C]``, frame mask ``[B, T]`` (bool) and each request's frame count."""
        normalised = []
        for wav in wavs:
            wav = torch.as_tensor(wav, dtype=torch.float32).reshape(-1)
            if wav.numel() == 0:
                raise SparkInputError("reference audio is empty")
            if not torch.isfinite(wav).all():
                raise SparkInputError("reference audio holds NaN or infinite samples")
            if wav.numel() < self.min_samples:
                raise SparkInputError(
                    f"reference audio has {wav.numel()} samples; at least {self.min_samples} are needed")
            normalised.append(normalize_waveform(wav))
        frames = [self.wav2vec2.params.frames(w.numel()) for w in normalised]
        batch = torch.nn.utils.rnn.pad_sequence(normalised, batch_first=True).to(self.device)
        mask = torch.arange(max(frames), device=self.device).unsqueeze(0) < torch.tensor(
            frames, device=self.device).unsqueeze(1)
        solo = len(wavs) == 1
        feats = self.wav2vec2(batch, None if solo else mask)
        return feats, mask, frames

    @torch.inference_mode()
    def tokenize(self, wavs: Sequence[np.ndarray | torch.Tensor]) -> list[AudioTokens]:
        """Tokens of each waveform (16 kHz, valid samples only), in order."""
        if not wavs:
            return []
        feats, mask, frames = self.features(wavs)
        semantic = self.bicodec.semantic_tokens(feats, None if len(wavs) == 1 else mask)
        global_tokens = self.global_tokens(wavs)
        return [AudioTokens(global_tokens[i].cpu(), semantic[i, : frames[i]].cpu()) for i in range(len(wavs))]
