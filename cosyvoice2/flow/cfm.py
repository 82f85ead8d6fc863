"""Conditional flow matching sampler: fixed-noise Euler ODE solve with classifier-free guidance
(docs/reference/cosyvoice2.md#conditional-flow-matching)."""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from speech_lm.graph_buckets import ReplayOrder, batch_bucket, capture, round_up
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

    For a given frame count T every estimator call has identical shapes. On CUDA the whole Euler loop is replayed
    from a CUDA graph per (batch, frame bucket, streaming) (`CFMGraphs`; the loop is launch-bound); set
    `cuda_graphs = None` to run it eagerly. `rand_noise` is a non-persistent buffer created on CPU even under a
    meta-device build; it is not in the state dict, so load with `assign=True` rather than `to_empty()`, which
    would overwrite it with garbage.
    """

    def __init__(self, estimator: CausalUNetEstimator, config: CFMConfig, noise: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.config = config
        self.estimator = estimator
        self.register_buffer("rand_noise", fixed_noise(config) if noise is None else noise, persistent=False)
        self.schedule = euler_schedule(config.n_timesteps)
        self.cuda_graphs: Optional[CFMGraphs] = CFMGraphs(self)

    def forward(
        self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False
    ) -> torch.Tensor:
        """mu, cond (B, 80, T); mask (B, 1, T); spks (B, 80) -> mel (B, 80, T) float32."""
        frames = mu.size(-1)
        if frames > self.rand_noise.size(-1):
            raise ValueError(f"flow call of {frames} frames exceeds the {self.rand_noise.size(-1)}-frame noise buffer")
        if self.cuda_graphs is not None and mu.is_cuda:
            return self.cuda_graphs.run(mu, mask, spks, cond, streaming)
        return self.solve(mu, mask, spks, cond, streaming).float()

    def solve(
        self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool
    ) -> torch.Tensor:
        """The Euler loop in the input dtype: static shapes, no host syncs (what `CFMGraphs` captures)."""
        batch, _, frames = mu.shape
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
        return x


class _CapturedSolve:
    """One captured Euler loop: static input buffers, the graph, its output buffer."""

    def __init__(self, cfm: CausalCFM, like: tuple[torch.Tensor, ...], streaming: bool, pool: object) -> None:
        self.inputs = tuple(torch.zeros_like(t) for t in like)  # mu, mask, spks, cond
        self.graph, self.output = capture(lambda: cfm.solve(*self.inputs, streaming), like[0].device, pool)


class CFMGraphs:
    """CUDA graphs of the CFM Euler loop per (batch bucket, frame bucket, streaming, dtype).

    Graphs pay off where the loop is launch-bound: small batches of short chunks (streaming). A shape is
    captured on its second occurrence (a one-off shape would pay a capture, a warm-up run and a replay for
    one call), only while padded rows x frames <= `max_graph_frames` (larger calls keep the GPU busy enough
    that eager launches hide behind the kernels), and at most `max_graphs` of them.

    A call of T frames runs in the bucket of ceil(T / frame_bucket) * frame_bucket frames, the extra frames
    masked out (mask 0, zero mu/cond): every estimator op is per-frame, causal, or attends only to unmasked
    keys, so the first T output frames equal an unpadded solve. The batch is padded to `batch_bucket` with
    all-masked rows (rows never interact). Graphs share one memory pool; replays are serialised by a lock
    because the input/output buffers are static.
    """

    def __init__(
        self, cfm: CausalCFM, frame_bucket: int = 128, max_graph_frames: int = 4096, max_graphs: int = 48
    ) -> None:
        self._cfm = [cfm]  # a list, so the module is not registered as a child (no cycle in the module tree)
        self.frame_bucket = frame_bucket
        self.max_graph_frames = max_graph_frames
        self.max_graphs = max_graphs
        self._seen: set[tuple] = set()
        self._captured: dict[tuple, _CapturedSolve] = {}
        self._pool: object | None = None
        self._lock = threading.Lock()
        self._order = ReplayOrder()  # token2wav workers on several CUDA streams share these graphs

    def padded_frames(self, frames: int) -> int:
        return round_up(frames, self.frame_bucket)

    def pad(
        self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Inputs padded at the end to the frame bucket and the batch bucket (zeros: masked frames and rows)."""
        extra = self.padded_frames(mu.size(-1)) - mu.size(-1)
        rows = batch_bucket(mu.size(0)) - mu.size(0)
        return (F.pad(mu, (0, extra, 0, 0, 0, rows)), F.pad(mask, (0, extra, 0, 0, 0, rows)),
                F.pad(spks, (0, 0, 0, rows)), F.pad(cond, (0, extra, 0, 0, 0, rows)))

    def run(
        self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, streaming: bool
    ) -> torch.Tensor:
        cfm, frames = self._cfm[0], mu.size(-1)
        inputs = self.pad(mu, mask, spks, cond)
        rows, padded = inputs[0].size(0), inputs[0].size(-1)
        if padded > cfm.rand_noise.size(-1) or rows * padded > self.max_graph_frames:
            return cfm.solve(mu, mask, spks, cond, streaming).float()
        key = (mu.device, mu.dtype, rows, padded, streaming)
        with self._lock:
            captured = self._captured.get(key)
            if captured is None:
                if key not in self._seen or len(self._captured) >= self.max_graphs:
                    self._seen.add(key)
                    return cfm.solve(mu, mask, spks, cond, streaming).float()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                captured = self._captured[key] = _CapturedSolve(cfm, inputs, streaming, self._pool)
            self._order.wait(mu.device)
            for static, value in zip(captured.inputs, inputs):
                static.copy_(value)
            captured.graph.replay()
            mel = captured.output[: mu.size(0), :, :frames].to(torch.float32, copy=True)
            self._order.record(mu.device)
            return mel
