"""Kernels where PyTorch has no single (or no fast) one.

- ``add_rms_norm(x, residual, weight, eps) -> (normed, summed)``: the residual add and the RMSNorm that follows it
  (the LLM decode step);
- ``silu_mul(gate_up) -> silu(gate) * up`` over the fused ``[..., 2 * I]`` gate|up projection (the LLM decode step);
- ``copy_runs(dst, src)``: ``dst.copy_(src)`` for strided tensors made of long contiguous runs, such as a stream's
  cached keys/values written into a slice of a static attention buffer. PyTorch copies any non-contiguous tensor
  with its generic element-by-element kernel (index arithmetic and a 2-byte access per bf16 element); on a GPU
  the flow's per-step key/value gathers ran at a fraction of the memory bandwidth that way;
- ``gather_rows(src, index)`` and ``scatter_rows(dst, index, src)``: ``src.index_select(1, index)`` and
  ``dst.index_copy_(1, index, src)`` for (outer, rows, width) views whose rows are contiguous, such as the packed
  flow's conv windows and new keys/values. PyTorch runs both element by element (index arithmetic and a 2-byte access
  per bf16 element; the copy's source is moreover a permuted view), ~22 ms of the 113 ms of kernel time of 16 first
  chunks' token2wav call on an H200; the kernels move whole rows with vectorised accesses.

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


def copy_runs(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (`src` broadcast to `dst`'s shape, same dtype and device): one Triton kernel with
    vectorised accesses where both are strided views of long contiguous runs, else PyTorch's copy."""
    _implementation(dst).copy_runs(dst, src)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(1, index)`` of a 3-D ``src`` (outer, rows, width) whose last dimension is contiguous: a new
    (outer, len(index), width) tensor."""
    return _implementation(src).gather_rows(src, index)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(1, index, src)`` for 3-D ``dst`` (outer, rows, width) and ``src`` (outer, len(index),
    width), last dimensions contiguous; where ``index`` repeats a row, one of its sources lands there."""
    _implementation(dst).scatter_rows(dst, index, src)
