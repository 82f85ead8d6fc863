"""Micro flow/HiFT modules with non-trivial random weights, built without a model directory.

(`cosyvoice2.testing.tiny_config` needs the frontend's audio stack, which GPU images may lack; this needs torch only.)
"""

from __future__ import annotations

import torch

from cosyvoice2.flow import EncoderConfig, EstimatorConfig, FlowConfig
from cosyvoice2.hift import HiFTConfig

TINY_FLOW = FlowConfig(encoder=EncoderConfig(width=16, attention_heads=2, linear_units=64, num_blocks=1),
                       estimator=EstimatorConfig(channels=16, attention_head_dim=16, num_heads=2, n_blocks=1,
                                                 num_mid_blocks=2))  # fmt: skip
TINY_HIFT = HiFTConfig(base_channels=16, f0_cond_channels=16)


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Default init plus random offsets, so that no norm weight or bias is a trivial 1 or 0."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return module.eval()
