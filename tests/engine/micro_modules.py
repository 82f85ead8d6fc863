"""Micro flow/HiFT modules with non-trivial random weights, built without a model directory.

(`cosyvoice2.testing.tiny_config` needs the frontend's audio stack, which GPU images may lack; this needs torch only.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cosyvoice2.flow import EncoderConfig, EstimatorConfig, FlowConfig
from cosyvoice2.hift import HiFTConfig

TINY_FLOW = FlowConfig(encoder=EncoderConfig(width=16, attention_heads=2, linear_units=64, num_blocks=1),
                       estimator=EstimatorConfig(channels=16, attention_head_dim=16, num_heads=2, n_blocks=1,
                                                 num_mid_blocks=2))  # fmt: skip
TINY_HIFT = HiFTConfig(base_channels=16, f0_cond_channels=16)


def randomized(make: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    """`make()`'s module: its default init plus random offsets (no norm weight or bias a trivial 1 or 0), both drawn
    after seeding, so the weights do not depend on what earlier tests drew from the global generator."""
    torch.manual_seed(seed)
    module = make()
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return module.eval()
