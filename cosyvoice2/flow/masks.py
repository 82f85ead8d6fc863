"""Static-chunk attention visibility shared by the encoder and the estimator."""

from __future__ import annotations

import torch


def chunk_visibility(length: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    """(length, length) bool: query i sees key j iff j < (i // chunk_size + 1) * chunk_size (no left limit)."""
    positions = torch.arange(length, device=device)
    chunk_end = (positions // chunk_size + 1) * chunk_size
    return positions.unsqueeze(0) < chunk_end.unsqueeze(1)
