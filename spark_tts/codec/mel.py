"""Magnitude mel spectrogram of the speaker reference clip, with the released model's exact conventions.

- STFT: periodic Hann window of ``win_length`` zero-padded (centred) to ``n_fft``, ``center=True`` with reflect
  padding, hop ``hop_length``, one-sided, not normalised; magnitude (power 1), no log.
- Filterbank: ``num_mels`` triangles on the Slaney mel scale (linear below 1 kHz at 200/3 Hz per mel, logarithmic
  above with step ln(6.4)/27 per mel) between ``mel_fmin`` and ``mel_fmax`` (default Nyquist), each scaled by
  ``2 / (f[i+2] - f[i])`` (Slaney area normalisation), evaluated on the ``n_fft // 2 + 1`` bin frequencies
  ``linspace(0, sample_rate // 2)``; computed in float32 in this order (the trained model's filterbank).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from spark_tts.config import MelParams

_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def hz_to_mel(hz: float) -> float:
    if hz < _MIN_LOG_HZ:
        return hz / _F_SP
    return _MIN_LOG_MEL + math.log(hz / _MIN_LOG_HZ) / _LOGSTEP


def mel_to_hz(mels: torch.Tensor) -> torch.Tensor:
    linear = _F_SP * mels
    logarithmic = _MIN_LOG_HZ * torch.exp(_LOGSTEP * (mels - _MIN_LOG_MEL))
    return torch.where(mels >= _MIN_LOG_MEL, logarithmic, linear)


def slaney_filterbank(p: MelParams) -> torch.Tensor:
    """``[n_fft // 2 + 1, num_mels]`` float32."""
    n_freqs = p.n_fft // 2 + 1
    f_max = float(p.sample_rate // 2) if p.mel_fmax is None else float(p.mel_fmax)
    bin_freqs = torch.linspace(0, p.sample_rate // 2, n_freqs)
    edges = mel_to_hz(torch.linspace(hz_to_mel(float(p.mel_fmin)), hz_to_mel(f_max), p.num_mels + 2))
    widths = edges[1:] - edges[:-1]
    slopes = edges.unsqueeze(0) - bin_freqs.unsqueeze(1)  # [n_freqs, num_mels + 2]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    fb = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return fb * (2.0 / (edges[2 : p.num_mels + 2] - edges[: p.num_mels])).unsqueeze(0)


class MelSpectrogram(nn.Module):
    """``[B, samples]`` -> ``[B, num_mels, frames]`` with ``frames = samples // hop_length + 1``.

    Window and filterbank are computed, not loaded (the released checkpoint does not store them).
    """

    def __init__(self, p: MelParams) -> None:
        super().__init__()
        self.params = p
        self.register_buffer("window", torch.hann_window(p.win_length, periodic=True), persistent=False)
        self.register_buffer("filterbank", slaney_filterbank(p), persistent=False)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        p = self.params
        spec = torch.stft(wav.float(), n_fft=p.n_fft, hop_length=p.hop_length, win_length=p.win_length,
                          window=self.window, center=True, pad_mode="reflect", normalized=False, onesided=True,
                          return_complex=True).abs()
        return torch.matmul(spec.transpose(-1, -2), self.filterbank).transpose(-1, -2)
