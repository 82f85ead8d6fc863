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

    def forward(self, mel: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mel (B, 80, M) -> f0 in Hz (B, M); with `mask` (B, 1, M) padded frames stay zero between the convs
        (the zero padding a row sees alone) and get f0 = 0."""
        hidden = mel if mask is None else mel * mask
        for layer in self.condnet:
            hidden = layer(hidden)
            if mask is not None and isinstance(layer, nn.ELU):
                hidden = hidden * mask
        f0 = self.classifier(hidden.transpose(1, 2)).squeeze(-1).abs()
        return f0 if mask is None else f0 * mask[:, 0]
