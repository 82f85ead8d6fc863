"""Acoustic features of the voice-prompt frontend, each equal to the upstream recipe
(docs/reference/cosyvoice2.md#frontend):

- `whisper_log_mel`: 128-bin Whisper log-mel at 16 kHz, input of the speech tokenizer;
- `speaker_fbank`: Kaldi 80-bin log fbank at 16 kHz minus its time mean, input of CAM++;
- `matcha_mel`: 80-bin natural-log mel at 24 kHz (50 Hz), the flow's prompt mel.
All take a 1-D float waveform in [-1, 1] at the stated rate.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

WHISPER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_N_MELS = 128

KALDI_FRAME_LENGTH = 400  # 25 ms at 16 kHz
KALDI_FRAME_SHIFT = 160  # 10 ms
KALDI_N_FFT = 512  # frame length rounded up to a power of two
KALDI_N_MELS = 80
KALDI_LOW_FREQ = 20.0
KALDI_PREEMPHASIS = 0.97

MEL_SAMPLE_RATE = 24000
MEL_N_FFT = 1920
MEL_HOP = 480
MEL_N_MELS = 80
MEL_FMAX = 8000.0


# ---- Slaney mel filterbank (librosa.filters.mel with htk=False, norm='slaney') ---------------------------
_SLANEY_LINEAR_HZ_PER_MEL = 200.0 / 3
_SLANEY_LOG_START_HZ = 1000.0
_SLANEY_LOG_START_MEL = _SLANEY_LOG_START_HZ / _SLANEY_LINEAR_HZ_PER_MEL  # 15
_SLANEY_LOG_STEP = math.log(6.4) / 27.0


def hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    """Linear below 1 kHz, logarithmic above."""
    linear = hz / _SLANEY_LINEAR_HZ_PER_MEL
    log = _SLANEY_LOG_START_MEL + torch.log(hz.clamp(min=_SLANEY_LOG_START_HZ) / _SLANEY_LOG_START_HZ) / _SLANEY_LOG_STEP
    return torch.where(hz >= _SLANEY_LOG_START_HZ, log, linear)


def slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = mel * _SLANEY_LINEAR_HZ_PER_MEL
    log = _SLANEY_LOG_START_HZ * torch.exp(_SLANEY_LOG_STEP * (mel - _SLANEY_LOG_START_MEL))
    return torch.where(mel >= _SLANEY_LOG_START_MEL, log, linear)


@lru_cache(maxsize=8)
def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) float32 triangles equally spaced on the Slaney mel scale, each scaled to
    unit area (2 / bandwidth in Hz); computed in float64 like librosa."""
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_hz = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    mel_edges = torch.linspace(hz_to_slaney_mel(torch.tensor(fmin, dtype=torch.float64)).item(),
                               hz_to_slaney_mel(torch.tensor(fmax, dtype=torch.float64)).item(),
                               n_mels + 2, dtype=torch.float64)
    edges_hz = slaney_mel_to_hz(mel_edges)
    widths = edges_hz.diff()
    distance = edges_hz[:, None] - fft_hz[None, :]  # (n_mels + 2, n_freqs)
    rising = -distance[:-2] / widths[:-1, None]
    falling = distance[2:] / widths[1:, None]
    triangles = torch.minimum(rising, falling).clamp(min=0)
    area_norm = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    return (triangles * area_norm[:, None]).to(torch.float32)


# ---- Whisper log-mel (speech tokenizer input) ------------------------------------------------------------
def whisper_log_mel(wav_16k: torch.Tensor) -> torch.Tensor:
    """(N,) -> (128, N // 160): log10 power mel, floored at max - 8, scaled by (x + 4) / 4."""
    window = torch.hann_window(WHISPER_N_FFT, device=wav_16k.device)
    spec = torch.stft(wav_16k, WHISPER_N_FFT, WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = spec[:, :-1].abs() ** 2  # Whisper drops the last frame
    filters = slaney_mel_filterbank(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_N_MELS).to(wav_16k.device)
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


# ---- Kaldi fbank (torchaudio.compliance.kaldi.fbank defaults with dither 0) -----------------------------
def _kaldi_mel(hz: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(hz / 700.0)


@lru_cache(maxsize=2)
def kaldi_mel_banks(sample_rate: int = WHISPER_SAMPLE_RATE) -> torch.Tensor:
    """(80, 257) triangles on the Kaldi mel scale (1127 ln(1 + f/700)) from 20 Hz to Nyquist, peak 1;
    the Nyquist bin gets weight 0 as in Kaldi."""
    n_bins = KALDI_N_FFT // 2
    bin_hz = sample_rate / KALDI_N_FFT
    mel_low = 1127.0 * math.log1p(KALDI_LOW_FREQ / 700.0)
    mel_high = 1127.0 * math.log1p(sample_rate / 2 / 700.0)
    delta = (mel_high - mel_low) / (KALDI_N_MELS + 1)
    index = torch.arange(KALDI_N_MELS).unsqueeze(1)
    left = mel_low + index * delta
    center = mel_low + (index + 1.0) * delta
    right = mel_low + (index + 2.0) * delta
    mel = _kaldi_mel(bin_hz * torch.arange(n_bins)).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.minimum(up, down).clamp(min=0)
    return F.pad(banks, (0, 1))


def _povey_window(length: int, device: torch.device) -> torch.Tensor:
    return torch.hann_window(length, periodic=False, device=device).pow(0.85)


def kaldi_fbank(wav_16k: torch.Tensor) -> torch.Tensor:
    """(N,) -> (1 + (N - 400) // 160, 80) log mel energies; frames that do not fit are dropped (snip_edges)."""
    if wav_16k.shape[-1] < KALDI_FRAME_LENGTH:
        return wav_16k.new_zeros(0, KALDI_N_MELS)
    frames = wav_16k.unfold(0, KALDI_FRAME_LENGTH, KALDI_FRAME_SHIFT)
    frames = frames - frames.mean(dim=1, keepdim=True)  # DC removal
    previous = F.pad(frames.unsqueeze(0), (1, 0), mode="replicate").squeeze(0)[:, :-1]
    frames = frames - KALDI_PREEMPHASIS * previous
    frames = frames * _povey_window(KALDI_FRAME_LENGTH, frames.device)
    frames = F.pad(frames, (0, KALDI_N_FFT - KALDI_FRAME_LENGTH))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    mel_energy = power @ kaldi_mel_banks().to(frames.device).T
    return torch.clamp(mel_energy, min=torch.finfo(torch.float32).eps).log()


def speaker_fbank(wav_16k: torch.Tensor) -> torch.Tensor:
    """CAM++ input: Kaldi fbank minus its per-utterance mean over time, (T, 80)."""
    feats = kaldi_fbank(wav_16k)
    return feats - feats.mean(dim=0, keepdim=True)


# ---- Matcha mel (flow prompt features) -------------------------------------------------------------------
def matcha_mel(wav_24k: torch.Tensor, fmax: float = MEL_FMAX) -> torch.Tensor:
    """(N,) -> (N // 480, 80): natural log of magnitude mel (floor 1e-5), hann 1920, hop 480, filters up to
    `fmax` (CosyVoice2: 8 kHz; CosyVoice3 uses the Nyquist frequency, 12 kHz)."""
    pad = (MEL_N_FFT - MEL_HOP) // 2
    padded = F.pad(wav_24k[None, None], (pad, pad), mode="reflect")[0, 0]
    window = torch.hann_window(MEL_N_FFT, device=wav_24k.device)
    spec = torch.stft(padded, MEL_N_FFT, MEL_HOP, MEL_N_FFT, window=window, center=False, return_complex=True)
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    filters = slaney_mel_filterbank(MEL_SAMPLE_RATE, MEL_N_FFT, MEL_N_MELS, 0.0, fmax).to(wav_24k.device)
    return torch.clamp(filters @ magnitude, min=1e-5).log().T
