"""The global (speaker) stream of BiCodec.

tokenize: mel ``[B, n_mels, T]`` -> ECAPA-TDNN frame features ``[B, 1536, T]`` -> Perceiver resampler to
``token_num`` latents -> FSQ indices ``[B, 1, token_num]``.
detokenize: indices -> FSQ codes -> ``project_out`` -> flattened channel-major -> ``project`` -> d-vector.

The ECAPA pooling/x-vector head (``pool``, ``bn``, ``linear``) is trained but unused by synthesis: tokenisation
never computes it. It stays in the module so that the checkpoint loads strictly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spark_tts.config import SpeakerParams


@dataclass(frozen=True)
class EcapaWidths:
    """Widths the released code hard-codes rather than configures; read from the checkpoint's shapes."""

    channels: int = 512  # trunk (``layer1.conv`` output channels)
    latent_channels: int = 1536  # ``conv`` output: the frame features the Perceiver reads
    pool_bottleneck: int = 128  # attentive-statistics pooling bottleneck
    se_bottleneck: int = 128  # squeeze-excitation bottleneck
    res2_scale: int = 8


class _ConvReluBn(nn.Module):
    """Conv1d -> ReLU -> BatchNorm (in that order, as trained)."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, padding: int = 0, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, padding=padding, dilation=dilation)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.relu(self.conv(x)))


class _Res2Conv(nn.Module):
    """Res2Net conv: ``scale`` channel groups; group i>0 adds the previous group's output before its conv;
    the last group passes through unchanged."""

    def __init__(self, channels: int, scale: int, dilation: int) -> None:
        super().__init__()
        self.width = channels // scale
        self.convs = nn.ModuleList(
            nn.Conv1d(self.width, self.width, 3, padding=dilation, dilation=dilation) for _ in range(scale - 1)
        )
        self.bns = nn.ModuleList(nn.BatchNorm1d(self.width) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.width, dim=1)
        outputs, carry = [], None
        for index, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            carry = parts[index] if carry is None else carry + parts[index]
            carry = bn(F.relu(conv(carry)))
            outputs.append(carry)
        outputs.append(parts[len(self.convs)])
        return torch.cat(outputs, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, bottleneck: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(channels, bottleneck)
        self.linear2 = nn.Linear(bottleneck, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.sigmoid(self.linear2(F.relu(self.linear1(x.mean(dim=2)))))
        return x * weights.unsqueeze(2)


class _SERes2Block(nn.Module):
    def __init__(self, channels: int, dilation: int, widths: EcapaWidths) -> None:
        super().__init__()
        self.se_res2block = nn.Sequential(
            _ConvReluBn(channels, channels),
            _Res2Conv(channels, widths.res2_scale, dilation),
            _ConvReluBn(channels, channels),
            _SqueezeExcite(channels, widths.se_bottleneck),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_res2block(x)


class _AttentiveStatsPool(nn.Module):
    """Attentive statistics pooling with global context (x-vector head only)."""

    def __init__(self, dim: int, bottleneck: int) -> None:
        super().__init__()
        self.linear1 = nn.Conv1d(dim * 3, bottleneck, kernel_size=1)
        self.linear2 = nn.Conv1d(bottleneck, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True).expand_as(x)
        std = torch.sqrt(x.var(dim=-1, keepdim=True) + 1e-7).expand_as(x)
        alpha = torch.softmax(self.linear2(torch.tanh(self.linear1(torch.cat((x, mean, std), dim=1)))), dim=2)
        weighted_mean = (alpha * x).sum(dim=2)
        var = (alpha * x.pow(2)).sum(dim=2) - weighted_mean.pow(2)
        return torch.cat([weighted_mean, var.clamp(min=1e-7).sqrt()], dim=1)


class EcapaTdnn(nn.Module):
    def __init__(self, feat_dim: int, embed_dim: int, widths: EcapaWidths) -> None:
        super().__init__()
        c = widths.channels
        self.layer1 = _ConvReluBn(feat_dim, c, kernel=5, padding=2)
        self.layer2 = _SERes2Block(c, 2, widths)
        self.layer3 = _SERes2Block(c, 3, widths)
        self.layer4 = _SERes2Block(c, 4, widths)
        self.conv = nn.Conv1d(3 * c, widths.latent_channels, kernel_size=1)
        self.pool = _AttentiveStatsPool(widths.latent_channels, widths.pool_bottleneck)
        self.bn = nn.BatchNorm1d(2 * widths.latent_channels)
        self.linear = nn.Linear(2 * widths.latent_channels, embed_dim)

    def frame_features(self, mel: torch.Tensor) -> torch.Tensor:
        """``[B, n_mels, T]`` -> ``[B, latent_channels, T]`` (what the Perceiver reads)."""
        out1 = self.layer1(mel)
        out2 = self.layer2(out1)
        out3 = self.layer3(out2)
        out4 = self.layer4(out3)
        return F.relu(self.conv(torch.cat([out2, out3, out4], dim=1)))

    def x_vector(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(self.bn(self.pool(features)))


class _CrossAttention(nn.Module):
    """Latents attend to [latents; context] (keys/values from both), multi-head, no bias."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, dim_head**-0.5
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch = latents.shape[0]
        q = self.to_q(latents)
        k, v = self.to_kv(torch.cat((latents, context), dim=1)).chunk(2, dim=-1)
        q, k, v = (t.reshape(batch, t.shape[1], self.heads, -1).transpose(1, 2) for t in (q, k, v))
        # explicit softmax attention (the trained model's formulation; the sizes are tiny)
        attention = (torch.einsum("bhid,bhjd->bhij", q, k) * self.scale).softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", attention, v)
        return self.to_out(out.transpose(1, 2).reshape(batch, latents.shape[1], -1))


class _GegluFeedForward(nn.Sequential):
    """Linear -> GEGLU (value half times GELU of gate half) -> Linear; keys ``0`` and ``2``."""

    class _Geglu(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            value, gate = x.chunk(2, dim=-1)
            return F.gelu(gate) * value

    def __init__(self, dim: int, mult: int = 4) -> None:
        inner = int(dim * mult * 2 / 3)
        super().__init__(nn.Linear(dim, inner * 2), self._Geglu(), nn.Linear(inner, dim))


class _ScaledRMSNorm(nn.Module):
    """``normalize(x) * sqrt(dim) * gamma``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = math.sqrt(dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class PerceiverResampler(nn.Module):
    """``[B, T, context_dim]`` -> ``[B, num_latents, dim]``; heads and head width are fixed by the trained model."""

    HEADS, DIM_HEAD, DEPTH = 8, 64, 2

    def __init__(self, dim: int, context_dim: int, num_latents: int) -> None:
        super().__init__()
        self.proj_context = nn.Linear(context_dim, dim)
        self.latents = nn.Parameter(torch.zeros(num_latents, dim))
        self.layers = nn.ModuleList(
            nn.ModuleList([_CrossAttention(dim, self.HEADS, self.DIM_HEAD), _GegluFeedForward(dim)])
            for _ in range(self.DEPTH)
        )
        self.norm = _ScaledRMSNorm(dim)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        context = self.proj_context(context)
        latents = self.latents.unsqueeze(0).expand(context.shape[0], -1, -1)
        for attention, feed_forward in self.layers:
            latents = attention(latents, context) + latents
            latents = feed_forward(latents) + latents
        return self.norm(latents)


class FiniteScalarQuantizer(nn.Module):
    """One-level residual FSQ with projections (``quantizer.project_in``/``project_out``).

    Per code dimension with L levels (L even here): bounded value ``tanh(z + atanh(0.5 / h)) * h - 0.5`` with
    ``h = (L - 1) * 1.001 / 2``, rounded half-to-even, plus ``L // 2`` gives the level ``0..L-1``; the index is the
    mixed-radix number of the levels (first dimension least significant). The code of a level is
    ``(level - L // 2) / (L // 2)``.
    """

    BOUND_EPS = 1e-3

    def __init__(self, dim: int, levels: tuple[int, ...]) -> None:
        super().__init__()
        if any(level % 2 for level in levels):
            raise ValueError("only even FSQ levels are supported (the released model uses 4)")
        self.project_in = nn.Linear(dim, len(levels))
        self.project_out = nn.Linear(len(levels), dim)
        levels_t = torch.tensor(levels, dtype=torch.int64)
        basis = torch.cumprod(torch.tensor((1,) + tuple(levels[:-1]), dtype=torch.int64), dim=0)
        self.register_buffer("levels", levels_t, persistent=False)
        self.register_buffer("basis", basis, persistent=False)

    def bounded(self, z: torch.Tensor) -> torch.Tensor:
        """The continuous value whose rounding is ``level - L // 2`` (float32 regardless of the model dtype)."""
        z = self.project_in(z).float()
        half_l = (self.levels - 1) * (1 + self.BOUND_EPS) / 2
        offset = 0.5
        shift = torch.atanh(offset / half_l)
        return (z + shift).tanh() * half_l - offset

    def tokenize(self, z: torch.Tensor) -> torch.Tensor:
        """``[B, N, dim]`` -> indices ``[B, N]`` (int64)."""
        levels = torch.round(self.bounded(z)).long() + self.levels // 2
        return (levels * self.basis).sum(dim=-1)

    def codes(self, indices: torch.Tensor) -> torch.Tensor:
        """indices ``[...]`` -> codes ``[..., len(levels)]`` in [-1, 1)."""
        half = self.levels // 2
        level = (indices.long().unsqueeze(-1) // self.basis) % self.levels
        return (level - half).float() / half

    def detokenize(self, indices: torch.Tensor) -> torch.Tensor:
        weight = self.project_out.weight
        return self.project_out(self.codes(indices).to(weight.dtype))


class SpeakerEncoder(nn.Module):
    def __init__(self, p: SpeakerParams, widths: EcapaWidths) -> None:
        super().__init__()
        self.token_num = p.token_num
        self.speaker_encoder = EcapaTdnn(p.input_dim, p.out_dim, widths)
        self.perceiver_sampler = PerceiverResampler(p.latent_dim, widths.latent_channels, p.token_num)
        if p.fsq_num_quantizers != 1:
            raise ValueError("only one FSQ quantizer is supported (the released model uses 1)")
        self.quantizer = FiniteScalarQuantizer(p.latent_dim, p.fsq_levels)
        self.project = nn.Linear(p.latent_dim * p.token_num, p.out_dim)

    def latents(self, mel: torch.Tensor) -> torch.Tensor:
        """mel ``[B, n_mels, T]`` -> Perceiver output ``[B, token_num, latent_dim]`` (token-major)."""
        features = self.speaker_encoder.frame_features(mel)
        return self.perceiver_sampler(features.transpose(1, 2))

    def tokenize(self, mel: torch.Tensor) -> torch.Tensor:
        """mel ``[B, n_mels, T]`` -> global tokens ``[B, token_num]`` (int64)."""
        return self.quantizer.tokenize(self.latents(mel))

    def detokenize(self, tokens: torch.Tensor) -> torch.Tensor:
        """global tokens ``[B, token_num]`` -> d-vector ``[B, out_dim]``."""
        z = self.quantizer.detokenize(tokens)  # [B, token_num, latent_dim]
        # flatten channel-major ([B, latent_dim, token_num]) as trained
        return self.project(z.transpose(1, 2).reshape(z.shape[0], -1))
