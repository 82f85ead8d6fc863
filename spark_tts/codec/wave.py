"""BiCodec's wave generator: DAC-style Snake/transposed-conv upsampler, ``prod(rates)`` samples per frame, tanh.

Every convolution is weight-normed in the checkpoint (``weight_g``/``weight_v``) and folded into a plain weight
at load (``spark_tts.loading``).
"""

from __future__ import annotations

import torch
from torch import nn

from spark_tts.codec.layers import Snake1d
from spark_tts.config import WaveParams


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation),
            Snake1d(dim),
            nn.Conv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        snake1, conv1, snake2, conv2 = self.block
        y = conv1(_masked(snake1(x), mask))
        return x + conv2(snake2(y))  # same length: the padding keeps it


class _UpsampleBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(cin),
            nn.ConvTranspose1d(cin, cout, kernel_size=kernel, stride=stride, padding=(kernel - stride) // 2),
            _ResidualUnit(cout, 1),
            _ResidualUnit(cout, 3),
            _ResidualUnit(cout, 9),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, up_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """mask: ``[B, 1, T]`` at the input rate; up_mask: the same at the output rate (both or neither)."""
        snake, upsample, *units = self.block
        x = upsample(_masked(snake(x), mask))
        for unit in units:
            x = unit(x, up_mask)
        return x


class WaveGenerator(nn.Module):
    def __init__(self, p: WaveParams) -> None:
        super().__init__()
        if len(p.rates) != len(p.kernel_sizes):
            raise ValueError("rates and kernel_sizes must pair up")
        layers: list[nn.Module] = [nn.Conv1d(p.input_channel, p.channels, kernel_size=7, padding=3)]
        width = p.channels
        for kernel, stride in zip(p.kernel_sizes, p.rates):
            layers.append(_UpsampleBlock(width, width // 2, kernel, stride))
            width //= 2
        layers += [Snake1d(width), nn.Conv1d(width, 1, kernel_size=7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, input_channel, T]`` -> ``[B, 1, T * prod(rates)]``.

        mask ``[B, 1, T]`` (1 = real frame): zeroes the padding of shorter rows before every convolution, at
        every rate, so each row's real samples equal its solo output (the padded tail's samples are junk).
        """
        first, *blocks, snake, last, tanh = self.model
        x = first(_masked(x, mask))
        for block in blocks:
            up_mask = None if mask is None else mask.repeat_interleave(block.block[1].stride[0], dim=-1)
            x = block(x, mask, up_mask)
            mask = up_mask
        return tanh(last(_masked(snake(x), mask)))

    def weight_normed(self) -> list[str]:
        """Names (relative to this module) of the layers stored weight-normed in the checkpoint."""
        return [name for name, m in self.named_modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
