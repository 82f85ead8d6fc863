"""Prompt audio: file loading (soundfile) and band-limited sinc resampling (torchaudio-equivalent)."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile
import torch
import torch.nn.functional as F

MIN_PROMPT_SAMPLE_RATE = 16000


def load_audio(source: str | Path | BinaryIO) -> tuple[np.ndarray, int]:
    """Read wav/flac/ogg (any soundfile format) -> (mono float32 samples in [-1, 1], sample rate).

    Channels are averaged, as upstream's `load_wav` does.
    """
    samples, sample_rate = soundfile.read(source, dtype="float32", always_2d=True)
    return samples.mean(axis=1, dtype=np.float32), int(sample_rate)


def resample(wav: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Resample (..., N) samples from `orig_sr` to `new_sr`: windowed-sinc interpolation with the defaults of
    torchaudio.transforms.Resample (Hann window, lowpass_filter_width 6, rolloff 0.99), output length
    ceil(N * new_sr / orig_sr)."""
    if orig_sr == new_sr:
        return wav
    gcd = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // gcd, new_sr // gcd
    kernel, width = _sinc_kernel(orig, new)
    shape = wav.shape
    flat = wav.reshape(-1, 1, shape[-1])
    padded = F.pad(flat, (width, width + orig))
    # one output channel per phase j/new of the output grid; interleave them back into time order
    phases = F.conv1d(padded, kernel.to(device=wav.device, dtype=wav.dtype), stride=orig)
    out = phases.transpose(1, 2).reshape(flat.shape[0], -1)
    out_len = math.ceil(new * shape[-1] / orig)
    return out[:, :out_len].reshape(*shape[:-1], out_len)


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, lowpass_filter_width: int = 6,
                 rolloff: float = 0.99) -> tuple[torch.Tensor, int]:
    """(new, 1, taps) float32 filter bank (computed in float64) and the half-width in input samples."""
    cutoff = min(orig, new) * rolloff  # relative to the reduced rates: anti-aliasing below the lower Nyquist
    width = math.ceil(lowpass_filter_width * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    # output phase offsets are float32 in torchaudio before promotion; keep that for identical kernels
    offsets = (torch.arange(0, -new, -1) / new).to(torch.float64)
    t = ((offsets[:, None] + taps[None, :]) * cutoff).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    kernel = sinc * (window * (cutoff / orig))
    return kernel.unsqueeze(1).to(torch.float32), width
