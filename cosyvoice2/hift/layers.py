"""Building blocks of the HiFT generator: weight-normed convolutions, Snake, MRF residual block."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm


def wn_conv1d(in_ch: int, out_ch: int, kernel: int, *, stride: int = 1, dilation: int = 1,
              padding: int = 0) -> nn.Conv1d:
    """Conv1d with torch's parametrized weight norm (state-dict keys `parametrizations.weight.original0/1`)."""
    return weight_norm(nn.Conv1d(in_ch, out_ch, kernel, stride, padding=padding, dilation=dilation))


def wn_conv_transpose1d(in_ch: int, out_ch: int, kernel: int, stride: int, padding: int) -> nn.ConvTranspose1d:
    # weight_norm's dim 0 of a transposed conv is in_channels, as in the released checkpoint.
    return weight_norm(nn.ConvTranspose1d(in_ch, out_ch, kernel, stride, padding=padding))


def same_padding(kernel: int, dilation: int) -> int:
    return (kernel * dilation - dilation) // 2


def fold_weight_norm(module: nn.Module) -> int:
    """Replace every weight-norm parametrization below `module` by its plain weight g * v / ||v||.

    Returns how many were folded. Inference output is unchanged up to fp rounding; the state dict
    afterwards has plain `.weight` keys, so fold only after loading the checkpoint.
    """
    folded = 0
    for sub in module.modules():
        if parametrize.is_parametrized(sub, "weight"):
            parametrize.remove_parametrizations(sub, "weight", leave_parametrized=True)
            folded += 1
    return folded


class Snake(nn.Module):
    """Snake activation with per-channel linear-scale alpha: x + sin^2(alpha x) / (alpha + 1e-9)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        return x + torch.sin(x * alpha).pow(2) / (alpha + 1e-9)


class ResBlock(nn.Module):
    """HiFi-GAN/BigVGAN residual block: per dilation, Snake -> dilated conv -> Snake -> conv, plus skip."""

    def __init__(self, channels: int, kernel: int, dilations: Sequence[int], causal: bool = False) -> None:
        """causal: every conv sees only the current and earlier frames (left zero padding of its receptive
        field; CosyVoice3's causal HiFT) instead of centred "same" padding."""
        super().__init__()
        self.causal = causal
        self.dilations = tuple(dilations)

        def padding(d: int) -> int:
            return 0 if causal else same_padding(kernel, d)

        self.convs1 = nn.ModuleList(
            wn_conv1d(channels, channels, kernel, dilation=d, padding=padding(d)) for d in dilations)
        self.convs2 = nn.ModuleList(wn_conv1d(channels, channels, kernel, padding=padding(1)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, T), zero where `mask` (B, 1, T) is 0. Re-zeroing after every conv gives each padded row
        the zero "same" padding it would see alone (Snake(0) = 0), so its real frames do not depend on the
        batch's padded length."""
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            h = conv1(self._left_pad(act1(x), conv1))
            if mask is not None:
                h = h * mask
            x = x + conv2(self._left_pad(act2(h), conv2))
            if mask is not None:
                x = x * mask
        return x

    def _left_pad(self, x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
        if not self.causal:
            return x
        return F.pad(x, (conv.dilation[0] * (conv.kernel_size[0] - 1), 0))
