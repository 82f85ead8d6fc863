"""Building blocks of BiCodec: Snake activation, ConvNeXt (Vocos) stacks with optional adaptive LayerNorm, and the
token-rate sampling block.

Sequence tensors are channel-first ``[B, C, T]`` unless a docstring says otherwise. ``mask`` arguments are
``[B, 1, T]`` float tensors (1 = real frame, 0 = padding of a shorter sequence in a batch): every convolution
sees zeros beyond a sequence's end exactly as it would if that sequence ran alone, so a batched sequence's real
frames equal its solo result (LayerNorms and linear layers work per frame and need no mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYER_NORM_EPS = 1e-6


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


class Snake1d(nn.Module):
    """``x + sin(alpha * x)^2 / alpha`` per channel (the 1e-9 keeps a zero alpha finite, as trained)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine parameters, then a per-utterance scale and shift computed from a condition."""

    def __init__(self, condition_dim: int, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.scale = nn.Linear(condition_dim, dim)
        self.shift = nn.Linear(condition_dim, dim)

    def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, C]`` (channel-last), condition ``[B, condition_dim]``."""
        normed = F.layer_norm(x, (self.dim,), eps=LAYER_NORM_EPS)
        return normed * self.scale(condition).unsqueeze(1) + self.shift(condition).unsqueeze(1)


def _norm(dim: int, condition_dim: int | None) -> nn.Module:
    return AdaLayerNorm(condition_dim, dim) if condition_dim else nn.LayerNorm(dim, eps=LAYER_NORM_EPS)


def _apply_norm(norm: nn.Module, x: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """Normalise channel-first ``x`` over channels; returns channel-last ``[B, T, C]``."""
    x = x.transpose(1, 2)
    if isinstance(norm, AdaLayerNorm):
        if condition is None:
            raise ValueError("this block is conditioned: pass the d-vector")
        return norm(x, condition)
    return norm(x)


class ConvNeXtBlock(nn.Module):
    """Depthwise conv (7 taps) -> norm -> pointwise MLP (GELU) -> layer scale ``gamma`` -> residual."""

    def __init__(self, dim: int, intermediate_dim: int, condition_dim: int | None) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = _norm(dim, condition_dim)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.pwconv2 = nn.Linear(intermediate_dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, condition: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        y = _apply_norm(self.norm, self.dwconv(_masked(x, mask)), condition)
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.transpose(1, 2)


class VocosBackbone(nn.Module):
    """Embedding conv (7 taps) -> norm -> ConvNeXt blocks -> final LayerNorm. Returns channel-last ``[B, T, C]``."""

    def __init__(
        self, input_channels: int, dim: int, intermediate_dim: int, num_layers: int, condition_dim: int | None = None
    ) -> None:
        super().__init__()
        self.embed = nn.Conv1d(input_channels, dim, kernel_size=7, padding=3)
        self.norm = _norm(dim, condition_dim)
        self.convnext = nn.ModuleList(
            ConvNeXtBlock(dim, intermediate_dim, condition_dim) for _ in range(num_layers)
        )
        self.final_layer_norm = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)

    def forward(
        self, x: torch.Tensor, condition: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = _apply_norm(self.norm, self.embed(_masked(x, mask)), condition).transpose(1, 2)
        for block in self.convnext:
            x = block(x, condition, mask)
        return self.final_layer_norm(x.transpose(1, 2))


class SamplingBlock(nn.Module):
    """Resampling by an integer ratio with skip paths; at ratio 1 (the released model) it is ``3 * x``.

    Up: repeat + LeakyReLU -> grouped transposed conv. Down: LeakyReLU -> grouped strided conv, plus average-pooled
    skips of the input. Input channel-last ``[B, T, C]``, output channel-first ``[B, C, T']``.
    """

    def __init__(self, dim: int, upsample_scale: int = 1, downsample_scale: int = 1) -> None:
        super().__init__()
        self.upsample_scale, self.downsample_scale = upsample_scale, downsample_scale
        if upsample_scale > 1:
            self.de_conv_upsampler = nn.Sequential(
                nn.LeakyReLU(0.2),
                nn.ConvTranspose1d(dim, dim, kernel_size=upsample_scale * 2, stride=upsample_scale,
                                   padding=upsample_scale // 2 + upsample_scale % 2,
                                   output_padding=upsample_scale % 2, groups=dim),
            )
        if downsample_scale > 1:
            self.conv_downsampler = nn.Sequential(
                nn.LeakyReLU(0.2),
                nn.Conv1d(dim, dim, kernel_size=2 * downsample_scale, stride=downsample_scale,
                          padding=downsample_scale // 2 + downsample_scale % 2, groups=dim),
            )

    @property
    def identity_rate(self) -> bool:
        return self.upsample_scale == 1 and self.downsample_scale == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        if self.upsample_scale > 1:
            repeated = x.repeat_interleave(self.upsample_scale, dim=2)
            merged = repeated + self.de_conv_upsampler(x)
        else:
            repeated = merged = x
        if self.downsample_scale > 1:
            scale = self.downsample_scale
            return (self.conv_downsampler(merged) + F.avg_pool1d(repeated, scale, scale)
                    + F.avg_pool1d(merged, scale, scale))
        return merged + repeated + merged


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weight of an old-style weight-normed layer: ``g * v / ||v||``, the norm over every dim but the first
    (the layout ``torch.nn.utils.weight_norm`` stores with its default ``dim=0``)."""
    dims = tuple(range(1, v.dim()))
    return g * v / v.norm(dim=dims, keepdim=True)
