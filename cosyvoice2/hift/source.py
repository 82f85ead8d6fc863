"""Neural-source-filter excitation: harmonic sines from F0 (upstream SourceModuleHnNSF with SineGen2).

Randomness is explicit: a `SourceNoise` holds the draws that upstream takes from torch's global generator,
so a caller can inject stored draws (parity) or draw them from a per-request `torch.Generator`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SourceNoise:
    """The random draws of one HiFT call.

    initial_phase: (B, H) uniform [0, 1) initial phase per harmonic (column 0, the fundamental, is ignored).
    sine_noise: (B, T, H) standard normal, scaled by the voiced/unvoiced noise amplitude.
    Upstream also draws a (B, T, 1) "noise branch" after these; no output depends on it, so it is not modelled.
    """

    initial_phase: torch.Tensor
    sine_noise: torch.Tensor

    @classmethod
    def draw(cls, batch: int, num_samples: int, num_harmonics: int, generator: torch.Generator | None = None,
             device: torch.device | str | None = None) -> "SourceNoise":
        """Draw in upstream's order and memory layout.

        With a CPU generator seeded like upstream's global generator this reproduces upstream's numbers:
        the sine noise is sampled into a transposed (B, H, T) buffer, as `randn_like` does for upstream's
        transposed sine tensor (torch's CPU normal sampler depends on the layout).
        """
        gen_device = generator.device if generator is not None else torch.device("cpu")
        initial_phase = torch.rand(batch, num_harmonics, generator=generator, device=gen_device)
        sine_noise = torch.empty(batch, num_harmonics, num_samples, device=gen_device).transpose(1, 2)
        sine_noise.normal_(generator=generator)
        return cls(initial_phase.to(device), sine_noise.to(device))


class HarmonicSource(nn.Module):
    """F0 at the audio rate -> merged harmonic excitation in (-1, 1) (upstream `m_source`)."""

    def __init__(self, sampling_rate: int, upsample_scale: int, nb_harmonics: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float, phase_upsampling: str = "linear") -> None:
        """phase_upsampling: how the frame-rate phase returns to the audio rate, "linear" (CosyVoice2) or
        "nearest" (CosyVoice3's causal HiFT: a sample's phase then depends on no later frame)."""
        super().__init__()
        if phase_upsampling not in ("linear", "nearest"):
            raise ValueError(f"phase_upsampling must be 'linear' or 'nearest', got {phase_upsampling!r}")
        self.phase_upsampling = phase_upsampling
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.num_harmonics = nb_harmonics + 1
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(self.num_harmonics, 1)

    def harmonic_sines(self, f0: torch.Tensor, initial_phase: torch.Tensor) -> torch.Tensor:
        """f0 (B, T, 1) Hz -> noiseless sines (B, T, H).

        The phase is integrated at the frame rate (linear down-sampling, cumulative sum, up-sampling by
        `phase_upsampling`), which keeps fp32 phase error small over long signals.
        """
        harmonic_numbers = torch.arange(1, self.num_harmonics + 1, device=f0.device, dtype=f0.dtype)
        rad = (f0 * harmonic_numbers / self.sampling_rate) % 1
        phase0 = initial_phase.to(rad).clone()
        phase0[:, 0] = 0
        rad[:, 0, :] = rad[:, 0, :] + phase0
        rad_frames = F.interpolate(rad.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear")
        phase_frames = torch.cumsum(rad_frames.transpose(1, 2), dim=1) * 2 * math.pi
        phase = F.interpolate(phase_frames.transpose(1, 2) * self.upsample_scale,
                              scale_factor=self.upsample_scale, mode=self.phase_upsampling).transpose(1, 2)
        return torch.sin(phase) * self.sine_amp

    def forward(self, f0: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        """f0 (B, T, 1) Hz -> source (B, 1, T)."""
        sines = self.harmonic_sines(f0, noise.initial_phase)
        voiced = (f0 > self.voiced_threshold).to(f0.dtype)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        excitation = sines * voiced + noise_amp * noise.sine_noise.to(sines)
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2)
