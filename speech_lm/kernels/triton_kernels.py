"""OpenAI Triton versions of ``reference``: one kernel launch each instead of two to four.

Rounding follows the reference: the residual sum is rounded to the input dtype before it is normalised; the norm
and the weight are applied in fp32 and rounded once; ``silu(gate)`` is rounded before the product, as
``F.silu(gate) * up`` does. Inputs are made contiguous along the last dimension (a no-op for Linear outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speech_lm.graph_buckets import on_device

_SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    summed = (x + residual).to(summed_ptr.dtype.element_ty)
    tl.store(summed_ptr + offsets, summed, mask=mask)
    value = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(value * value, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (value * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = x.shape[-1]
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    with on_device(x.device):  # Triton launches on the current device's stream: make it x's
        _add_rms_norm_kernel[(x.numel() // n_cols,)](
            x, residual, weight, out, summed, n_cols, eps, BLOCK=triton.next_power_of_2(n_cols)
        )
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n_cols = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], n_cols)
    with on_device(gate_up.device):
        _silu_mul_kernel[(gate_up.numel() // (2 * n_cols), triton.cdiv(n_cols, _SILU_BLOCK))](
            gate_up, out, n_cols, BLOCK=_SILU_BLOCK
        )
    return out
