"""Wall-clock timing of GPU work for the engine-level benchmarks: CUDA runs asynchronously, so a timer must wait
for the device before it starts and before it stops, or it measures only the kernel launches."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of `fn()`, with the device idle before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result
