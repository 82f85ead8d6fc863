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
_COPY_BLOCK = 2048
_ROWS_BLOCK = 1024
#: `copy_runs` hands shorter runs, more outer dimensions (after merging) or other dtypes to PyTorch's copy.
_COPY_MIN_RUN = 256
_COPY_OUTER_DIMS = 4


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


@triton.jit
def _copy_runs_kernel(dst_ptr, src_ptr, run, n1, n2, n3, d0, d1, d2, d3, s0, s1, s2, s3, BLOCK: tl.constexpr):
    # program (outer, block): BLOCK elements of the contiguous run at outer index (i0, i1, i2, i3)
    outer = tl.program_id(0).to(tl.int64)
    i3 = outer % n3
    outer = outer // n3
    i2 = outer % n2
    outer = outer // n2
    i1 = outer % n1
    i0 = outer // n1
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < run
    values = tl.load(src_ptr + (i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3) + cols, mask=mask)
    tl.store(dst_ptr + (i0 * d0 + i1 * d1 + i2 * d2 + i3 * d3) + cols, values, mask=mask)


def _runs(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, list[tuple[int, int, int]]] | None:
    """(run length, outer dims as (size, dst stride, src stride)) when both tensors are the same contiguous runs
    laid out by at most `_COPY_OUTER_DIMS` outer dimensions; None otherwise."""
    dims = [(n, ds, ss) for n, ds, ss in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:  # trailing dims contiguous in both
        run *= dims.pop()[0]
    outer: list[tuple[int, int, int]] = []
    for n, ds, ss in dims:  # merge an outer dim into the previous one where both tensors allow it
        if outer and outer[-1][1] == ds * n and outer[-1][2] == ss * n:
            outer[-1] = (outer[-1][0] * n, ds, ss)
        else:
            outer.append((n, ds, ss))
    if not dims or run < _COPY_MIN_RUN or len(outer) > _COPY_OUTER_DIMS or triton.cdiv(run, _COPY_BLOCK) > 65535:
        return None
    return run, [(1, 0, 0)] * (_COPY_OUTER_DIMS - len(outer)) + outer


def copy_runs(dst: torch.Tensor, src: torch.Tensor) -> None:
    src = src.expand_as(dst)
    layout = _runs(dst, src) if src.dtype == dst.dtype and src.device == dst.device else None
    if layout is None:  # contiguous (PyTorch's copy is a memcpy), short runs, or a layout the kernel does not take
        dst.copy_(src)
        return
    run, outer = layout
    (_, d0, s0), (n1, d1, s1), (n2, d2, s2), (n3, d3, s3) = outer
    programs = outer[0][0] * n1 * n2 * n3
    with on_device(dst.device):
        _copy_runs_kernel[(programs, triton.cdiv(run, _COPY_BLOCK))](
            dst, src, run, n1, n2, n3, d0, d1, d2, d3, s0, s1, s2, s3, BLOCK=_COPY_BLOCK
        )


@triton.jit
def _rows_kernel(dst_ptr, src_ptr, index_ptr, width, dst_outer, dst_row, src_outer, src_row, GATHER: tl.constexpr,
                 BLOCK: tl.constexpr):
    # program (i, outer, block): BLOCK elements of row index[i] (gather: of src into row i of dst; scatter: row i of
    # src into row index[i] of dst) at one outer index
    i = tl.program_id(0).to(tl.int64)
    outer = tl.program_id(1).to(tl.int64)
    row = tl.load(index_ptr + i).to(tl.int64)
    src_at = row if GATHER else i
    dst_at = i if GATHER else row
    cols = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    values = tl.load(src_ptr + outer * src_outer + src_at * src_row + cols, mask=mask)
    tl.store(dst_ptr + outer * dst_outer + dst_at * dst_row + cols, values, mask=mask)


def _rows_fit(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether the row kernel takes these tensors: 3-D, last dimensions contiguous, one dtype and device, a
    non-empty 1-D index, and a grid within CUDA's limits."""
    return (dst.dim() == 3 and src.dim() == 3 and dst.stride(2) == 1 and src.stride(2) == 1
            and dst.dtype == src.dtype and dst.device == src.device == index.device and index.dim() == 1
            and index.numel() > 0 and dst.shape[0] <= 65535
            and triton.cdiv(dst.shape[2], _ROWS_BLOCK) <= 65535)  # fmt: skip


def _launch_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor, gather: bool) -> None:
    width = dst.shape[2]
    block = min(triton.next_power_of_2(width), _ROWS_BLOCK)
    with on_device(dst.device):
        _rows_kernel[(index.numel(), dst.shape[0], triton.cdiv(width, block))](
            dst, src, index, width, dst.stride(0), dst.stride(1), src.stride(0), src.stride(1), GATHER=gather,
            BLOCK=block)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if not _rows_fit(src, src, index):  # the new output is contiguous, like src's dtype and device: src decides
        return src.index_select(1, index)
    out = src.new_empty(src.shape[0], index.numel(), src.shape[2])
    _launch_rows(out, src, index, gather=True)
    return out


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    if src.shape != (dst.shape[0], index.numel(), dst.shape[2]):
        raise ValueError(f"scatter_rows: a source of {tuple(src.shape)} for {index.numel()} rows of {tuple(dst.shape)}")
    if _rows_fit(dst, src, index):
        _launch_rows(dst, src, index, gather=False)
    else:
        dst.index_copy_(1, index, src)

