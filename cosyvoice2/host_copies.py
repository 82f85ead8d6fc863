"""Copies between the host and a GPU that do not stall the host thread on every call.

`torch.tensor(a_list, device="cuda")` and `tensor.cpu()` each wait until the GPU has run everything queued on the
stream so far, so a loop that builds a few small index tensors per step and copies each result back on its own
spends its time waiting instead of queueing the next kernels. Here host-to-device copies go through pinned memory
without a wait, and the results of one call come back in one copy and one wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


def to_device(values: Sequence, device: "torch.device", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """`torch.tensor(values, dtype=dtype, device=device)` without waiting for the device's queued work (CUDA: the
    values are staged in pinned host memory, whose caching allocator keeps the block until the copy has run)."""
    import torch

    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensors: Sequence["torch.Tensor | np.ndarray"]) -> list[np.ndarray]:
    """Each tensor as a float32 numpy array (arrays pass through): GPU tensors gathered into one buffer, copied in
    one transfer and waited for once (instead of a copy and a wait per tensor)."""
    import torch

    on_gpu = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.is_cuda]
    out: list = [t if isinstance(t, np.ndarray) else t.detach().float().numpy() if not t.is_cuda else None
                 for t in tensors]
    if not on_gpu:
        return out
    flat = torch.cat([tensors[i].detach().reshape(-1).float() for i in on_gpu])
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    array = host.numpy()
    offset = 0
    for i in on_gpu:
        size = tensors[i].numel()
        out[i] = array[offset : offset + size].reshape(tensors[i].shape)
        offset += size
    return out
