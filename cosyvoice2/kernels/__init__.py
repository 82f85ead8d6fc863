"""Fused elementwise kernels where PyTorch has no single kernel: the LLM decode step's and the flow estimator's.

- ``add_rms_norm(x, residual, weight, eps) -> (normed, summed)``: the residual add and the RMSNorm that follows it;
- ``silu_mul(gate_up) -> silu(gate) * up`` over the fused ``[..., 2 * I]`` gate|up projection;
- ``layer_norm(x, weight, bias, eps, mish, mask)``: LayerNorm over the last dimension, optionally followed by Mish
  and a per-row mask (``mask`` has one value per row of ``x``), as the flow estimator's causal blocks apply them;
- ``add_layer_norm(x, residual, weight, bias, eps) -> (normed, summed)``: the residual add and the LayerNorm after
  it, as in the estimator's transformer blocks.

The two LayerNorm kernels are not wired into the estimator yet. In its CUDA graphs they make a step ~9 % faster
(H200, bf16, 1-16 rows), but a Triton launch from Python costs several times a PyTorch op's host time, and the
estimator's eager calls (offline, more than 16 rows) launch ~1 400 of them per call: used everywhere they made
the whole stack slower (docs/PERFORMANCE.md). They belong in graph captures only.

On CUDA with OpenAI Triton installed they run as one Triton kernel each (``triton_kernels``, graph-capturable:
no host syncs, shapes fixed per call); elsewhere as the PyTorch compositions in ``reference``, which define the
results (``scripts/gpu_kernel_check.py`` compares the two).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from cosyvoice2.kernels import reference


@cache
def _triton_kernels() -> ModuleType | None:
    try:
        from cosyvoice2.kernels import triton_kernels  # noqa: PLC0415 - optional dependency
    except ImportError:
        return None
    return triton_kernels


def _implementation(tensor: torch.Tensor) -> ModuleType:
    fused = _triton_kernels() if tensor.is_cuda else None
    return fused or reference


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = x + residual`` (rounded to the input dtype) and ``rms_norm(summed) * weight``."""
    return _implementation(x).add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = gate_up.chunk(2, dim=-1)``."""
    return _implementation(gate_up).silu_mul(gate_up)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, mish: bool = False,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """``layer_norm(x)``, then ``mish`` when asked, then ``* mask`` (one value per row, broadcast over the last
    dimension), each rounded to the input dtype as the separate PyTorch ops round."""
    return _implementation(x).layer_norm(x, weight, bias, eps, mish, mask)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = x + residual`` (rounded to the input dtype) and ``layer_norm(summed)``."""
    return _implementation(x).add_layer_norm(x, residual, weight, bias, eps)
