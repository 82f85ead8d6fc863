"""Shape buckets for CUDA-graph replays: calls are padded up to a few sizes, so a handful of graphs serves any
batch (padded rows and frames are masked, hence exact on the real ones)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def batch_bucket(batch: int) -> int:
    """1, 2, 4, 8, then multiples of 8."""
    return 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ReplayOrder:
    """Orders the replays of one set of CUDA graphs across CUDA streams.

    A set of graphs shares static input buffers and one memory pool, so a replay may start only after the
    previous one has run. A lock orders the launches of several threads, but their CUDA streams could still
    run two replays at once on the GPU: each replay therefore waits (on the GPU, the host does not block) for
    the event recorded after the previous one, wherever it was launched."""

    def __init__(self) -> None:
        self._done = None

    def wait(self, device: "torch.device") -> None:
        import torch

        if self._done is not None:
            torch.cuda.current_stream(device).wait_event(self._done)

    def record(self, device: "torch.device") -> None:
        import torch

        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._done = done
