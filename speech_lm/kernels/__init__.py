"""Fused elementwise kernels of the LLM decode step, where PyTorch has no single kernel.

- ``add_rms_norm(x, residual, weight, eps) -> (normed, summed)``: the residual add and the RMSNorm that follows it;
- ``silu_mul(gate_up) -> silu(gate) * up`` over the fused ``[..., 2 * I]`` gate|up projection.

On CUDA with OpenAI Triton installed they run as one Triton kernel each (``triton_kernels``, graph-capturable:
no host syncs, shapes fixed per call); elsewhere as the PyTorch compositions in ``reference``, which define the
results (``tests/gpu/test_kernels.py`` compares the two on a GPU, ``tests/engine/test_llm_kernels.py`` in
Triton's interpreter on the CPU).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch

from speech_lm.kernels import reference


@cache
def _triton_kernels() -> ModuleType | None:
    try:
        from speech_lm.kernels import triton_kernels  # noqa: PLC0415 - optional dependency
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
