"""PyTorch definitions of the fused kernels (used on CPU and wherever Triton is unavailable)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return F.rms_norm(summed, weight.shape, weight, eps), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def copy_runs(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return src.index_select(1, index)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    dst.index_copy_(1, index, src)
