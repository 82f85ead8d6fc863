"""Shape buckets for CUDA-graph replays: calls are padded up to a few sizes, so a handful of graphs serves any
batch (padded rows and frames are masked, hence exact on the real ones)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def batch_bucket(batch: int) -> int:
    """1, 2, 4, 8, then multiples of 8."""
    return 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8


def row_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `largest`, then `largest` itself: the row counts of a set of graphs that serves calls of
    up to `largest` rows."""
    return tuple(1 << i for i in range((largest - 1).bit_length()) if 1 << i < largest) + (largest,)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def fit(values: Sequence[int], sizes: Sequence[Sequence[int]]) -> Optional[tuple[int, ...]]:
    """Per dimension the smallest bucket size >= the value (`sizes[i]` ascending), or None when a value is larger
    than every size of its dimension (the call then runs eagerly)."""
    picked = []
    for value, options in zip(values, sizes):
        size = next((s for s in options if s >= value), None)
        if size is None:
            return None
        picked.append(size)
    return tuple(picked)


def concrete_device(device: "torch.device") -> "torch.device":
    """`cuda` -> `cuda:<current device>`. A tensor's device always carries an index, so an index-less device
    never compares equal to it: a cache keyed on the device would be rebuilt on every call."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def capture(run: Callable[[], T], device: "torch.device", pool: object) -> tuple["torch.cuda.CUDAGraph", T]:
    """`run` (static shapes, no host syncs) captured into a new CUDA graph in `pool`; returns the graph and the
    outputs of the captured call, which each replay overwrites.

    `run` is called once before, on a side stream: lazy initialisations (cuBLAS workspaces, cuDNN/cuFFT plans)
    must not happen during capture."""
    import torch

    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device), capture_error_mode="thread_local"):
            outputs = run()
    return graph, outputs


def capture_stream(device: "torch.device") -> "torch.cuda.Stream":
    """A side stream of `device` to capture on. `torch.cuda.graph` otherwise captures on one stream it creates
    once per process on whatever device is current then: with the tensors on another GPU (an instance on GPU 1
    of a process whose current device is 0), the capture runs on the wrong device and is invalidated."""
    import torch

    device = concrete_device(device)
    stream = _CAPTURE_STREAMS.get(device.index)
    if stream is None:
        stream = _CAPTURE_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


_CAPTURE_STREAMS: dict = {}


def on_device(device: "torch.device | str | None"):
    """A context in which `device` is the current CUDA device (nothing for CPU devices): what is created without a
    device (streams, events, graphs, `torch.cuda.current_stream()`) then lands on the GPU the model owns."""
    import contextlib

    import torch

    if device is None or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(concrete_device(torch.device(device)))


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
