"""Conditional flow matching sampler: fixed-noise Euler ODE solve with classifier-free guidance (spec §3.5)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .config import CFMConfig
from .estimator import CausalUNetEstimator


def fixed_noise(config: CFMConfig) -> torch.Tensor:
    """Upstream's construction-time noise: equal to `torch.manual_seed(0); torch.randn(1, 80, 15000)` on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(config.noise_seed)
    return torch.randn(1, 80, config.noise_frames, generator=generator, device="cpu")


def euler_schedule(n_timesteps: int) -> list[tuple[float, float]]:
    """(t, dt) per Euler step on the cosine grid t_k = 1 - cos(k/n * pi/2).

    Mirrors upstream's float32 recurrence (t accumulates dt, dt = t_span[k+1] - t) so every step sees the same t.
    """
    grid = 1 - torch.cos(torch.linspace(0, 1, n_timesteps + 1, dtype=torch.float32, device="cpu") * 0.5 * math.pi)
    steps = []
    t, dt = grid[0], grid[1] - grid[0]
    for k in range(1, n_timesteps + 1):
        steps.append((t.item(), dt.item()))
        t = t + dt
        if k < n_timesteps:
            dt = grid[k + 1] - t
    return steps


class CausalCFM(nn.Module):
    """Runs the estimator n_timesteps times on a (2B, ...) batch: conditional rows then unconditional rows.

    For a given frame count T every estimator call has identical shapes (graph capture / compile friendly).
    `rand_noise` is a non-persistent buffer created on CPU even under a meta-device build; it is not in the
    state dict, so load with `assign=True` rather than `to_empty()`, which would overwrite it with garbage.
    """

    def __init__(self, estimator: CausalUNetEstimator, config: CFMConfig, noise: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.config = config
        self.estimator = estimator
        self.register_buffer("rand_noise", fixed_noise(config) if noise is None else noise, persistent=False)
        self.schedule = euler_schedule(config.n_timesteps)

    def forward(
        self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False
    ) -> torch.Tensor:
        """mu, cond (B, 80, T); mask (B, 1, T); spks (B, 80) -> mel (B, 80, T) float32."""
        batch, _, frames = mu.shape
        if frames > self.rand_noise.size(-1):
            raise ValueError(f"flow call of {frames} frames exceeds the {self.rand_noise.size(-1)}-frame noise buffer")
        x = self.rand_noise[:, :, :frames].to(mu).expand(batch, -1, -1)
        mask_in = torch.cat([mask, mask])
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        bias = self.estimator.attention_bias(mask_in, streaming)
        rate = self.config.inference_cfg_rate
        for t, dt in self.schedule:
            t_in = torch.full((2 * batch,), t, dtype=mu.dtype, device=mu.device)
            velocity = self.estimator(torch.cat([x, x]), mask_in, mu_in, t_in, spks_in, cond_in, bias)
            v_cond, v_uncond = velocity[:batch], velocity[batch:]
            x = x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)
        return x.float()
