"""F0 predictor (upstream ConvRNNF0Predictor): 5 x (weight-normed conv k3 + ELU), linear head, |.|."""

from __future__ import annotations

import torch
from torch import nn

from .layers import wn_conv1d


class F0Predictor(nn.Module):
    NUM_CONVS = 5

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(self.NUM_CONVS):
            layers += [wn_conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # conv indices 0, 2, 4, 6, 8 as in hift.pt
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, M) -> f0 in Hz (B, M)."""
        hidden = self.condnet(mel).transpose(1, 2)
        return self.classifier(hidden).squeeze(-1).abs()
