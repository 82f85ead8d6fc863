"""Frontend features and resampling. Reference numbers come from independent implementations run outside
this repository: librosa 0.11 (`librosa.filters.mel`, `librosa.stft`, float64) for the Slaney filterbank,
Whisper log-mel and Matcha mel, and kaldi-native-fbank 1.22 (Kaldi's C++ fbank) for the Kaldi fbank."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cosyvoice2.frontend.audio import resample
from cosyvoice2.frontend.features import (
    hz_to_slaney_mel,
    kaldi_fbank,
    matcha_mel,
    slaney_mel_filterbank,
    slaney_mel_to_hz,
    speaker_fbank,
    whisper_log_mel,
)


def test_signal(sample_rate: int, n: int) -> torch.Tensor:
    t = np.arange(n, dtype=np.float64) / sample_rate
    x = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t + 0.3) + 0.05 * np.sin(2 * np.pi * 7000 * t)
    return torch.from_numpy(x.astype(np.float32))


test_signal.__test__ = False  # a helper, not a test


# ---- Slaney mel filterbank ----------------------------------------------------------------------------------
def test_slaney_scale_known_points() -> None:
    hz = torch.tensor([0.0, 500.0, 1000.0, 6400.0], dtype=torch.float64)
    # linear 200/3 Hz per mel up to 1 kHz (= 15 mel); 27 mel per factor 6.4 above
    expected = torch.tensor([0.0, 7.5, 15.0, 42.0], dtype=torch.float64)
    assert torch.allclose(hz_to_slaney_mel(hz), expected, atol=1e-12)
    assert torch.allclose(slaney_mel_to_hz(expected), hz, atol=1e-9)


def test_slaney_filterbank_matches_librosa_values() -> None:
    whisper = slaney_mel_filterbank(16000, 400, 128)
    matcha = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert whisper.shape == (128, 201) and matcha.shape == (80, 961)
    assert whisper.max().item() == pytest.approx(0.04168175, abs=1e-8)
    assert matcha.max().item() == pytest.approx(0.02666536, abs=1e-8)
    assert whisper[0, 1].item() == pytest.approx(0.012373987, abs=1e-8)
    assert matcha[79, 600:603].tolist() == pytest.approx([0.00106623, 0.00121196, 0.00135769], abs=1e-8)


def test_slaney_filters_have_unit_area() -> None:
    # area-normalised triangles: sum of weights * bin spacing ~ 1 for filters many bins wide
    matcha = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0).double()
    bin_hz = 24000 / 1920
    areas = matcha.sum(dim=1) * bin_hz
    assert torch.allclose(areas[20:], torch.ones(60, dtype=torch.float64), atol=0.02)
    assert (matcha[:, 8000 // int(bin_hz) + 1:] == 0).all()  # nothing above fmax


# ---- features against references -------------------------------------------------------------------------
def test_whisper_log_mel_matches_reference() -> None:
    feats = whisper_log_mel(test_signal(16000, 8000))
    assert feats.shape == (128, 50)  # N // 160: the last STFT frame is dropped
    expected = torch.tensor([[1.0897751, -0.5146459, 0.5460222],
                             [1.1786222, 1.337491, 1.3359039],
                             [1.1216174, 1.175127, 1.1749403],
                             [0.4182119, -0.5146459, -0.3705511]])
    assert torch.allclose(feats[[9, 17, 87, 127]][:, [0, 25, 49]], expected, atol=1e-4)
    assert feats.min().item() == pytest.approx(feats.max().item() - 2.0, abs=1e-6)  # max - 8 floor, scaled by 1/4


def test_kaldi_fbank_matches_kaldi() -> None:
    feats = kaldi_fbank(test_signal(16000, 8000))
    assert feats.shape == (48, 80)  # 1 + (8000 - 400) // 160, snip_edges
    expected = torch.tensor([[-11.553131, -2.9943318, -14.830942, 6.616723, -11.563001],
                             [-11.553131, -2.9943318, -14.830942, 6.616723, -11.563001],
                             [-10.600831, -2.999693, -14.702474, 6.616723, -11.559588]])
    assert torch.allclose(feats[[0, 20, 47]][:, [0, 17, 40, 52, 79]], expected, atol=2e-4)


def test_speaker_fbank_is_mean_normalised() -> None:
    wav = test_signal(16000, 8000) * torch.linspace(0.2, 1.0, 8000)
    feats = speaker_fbank(wav)
    assert torch.allclose(feats.mean(dim=0), torch.zeros(80), atol=1e-5)
    assert torch.allclose(feats, kaldi_fbank(wav) - kaldi_fbank(wav).mean(dim=0), atol=1e-6)


def test_kaldi_fbank_short_input_has_no_frames() -> None:
    assert kaldi_fbank(torch.zeros(399)).shape == (0, 80)
    assert kaldi_fbank(torch.zeros(400)).shape == (1, 80)


def test_matcha_mel_matches_reference() -> None:
    mel = matcha_mel(test_signal(24000, 12000))
    assert mel.shape == (25, 80)  # N // 480
    expected = torch.tensor([[-0.4598177, 2.266379, 0.3600593, -1.4985195],
                             [-10.0412684, 2.2697934, -0.2967926, -2.3988332],
                             [-0.4737741, 2.258686, 0.3212736, -2.1496065]])
    # rtol covers fp32 STFT rounding in the near-silent bin 0 of frame 12 (value ~ log(4e-5))
    assert torch.allclose(mel[[0, 12, 24]][:, [0, 11, 55, 77]], expected, atol=1e-4, rtol=2e-4)


@pytest.mark.parametrize("n", [480 * 7, 480 * 7 + 479])
def test_matcha_frame_count(n: int) -> None:
    assert matcha_mel(torch.randn(n) * 0.1).shape == (7, 80)


# ---- resampler -----------------------------------------------------------------------------------------------
def sine(freq: float, sample_rate: int, seconds: float) -> torch.Tensor:
    t = torch.arange(int(sample_rate * seconds), dtype=torch.float64) / sample_rate
    return torch.sin(2 * math.pi * freq * t).float()


def amplitude_at(signal: torch.Tensor, sample_rate: int, freq: float) -> float:
    """Amplitude of one frequency by projection on a Hann-windowed complex exponential."""
    n = signal.numel()
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    window = torch.hann_window(n, dtype=torch.float64)
    phasor = torch.exp(-2j * math.pi * freq * t)
    return (2 * (signal.double() * window * phasor).sum().abs() / window.sum()).item()


@pytest.mark.parametrize("orig, new", [(22050, 16000), (24000, 16000), (22050, 24000), (16000, 24000),
                                       (48000, 24000)])
def test_resample_preserves_in_band_sine(orig: int, new: int) -> None:
    out = resample(sine(1000.0, orig, 0.5), orig, new)
    assert out.shape == (math.ceil(0.5 * orig * new / orig),)
    expected = sine(1000.0, new, 0.5)[: out.numel()]
    edge = new // 100  # the signal starts/ends abruptly; compare away from the edges
    assert (out[edge:-edge] - expected[edge:-edge]).abs().max().item() < 2e-3


def test_resample_rejects_aliasing() -> None:
    # 11 kHz is above the 8 kHz Nyquist of the 16 kHz output: it must be filtered (>= 40 dB), not folded to 5 kHz
    out = resample(sine(11000.0, 24000, 0.5), 24000, 16000)
    assert amplitude_at(out, 16000, 5000.0) < 1e-2
    assert amplitude_at(resample(sine(5000.0, 24000, 0.5), 24000, 16000), 16000, 5000.0) > 0.99


def test_resample_cutoff_is_at_rolloff() -> None:
    # windowed-sinc low-pass: half amplitude exactly at the cutoff 0.99 x the lower Nyquist (7920 Hz)
    def gain(freq: float) -> float:
        return amplitude_at(resample(sine(freq, 24000, 0.5), 24000, 16000), 16000, freq)

    assert gain(7920.0) == pytest.approx(0.5, abs=0.02)
    assert gain(6000.0) > 0.98


def test_resample_batch_and_identity() -> None:
    batch = torch.stack([sine(300.0, 22050, 0.1), sine(700.0, 22050, 0.1)])
    out = resample(batch, 22050, 16000)
    assert out.shape == (2, math.ceil(2205 * 16000 / 22050))
    assert torch.allclose(out[1], resample(batch[1], 22050, 16000), atol=1e-6)
    assert resample(batch, 16000, 16000) is batch
