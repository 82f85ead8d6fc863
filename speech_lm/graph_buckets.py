"""Shape buckets for CUDA-graph replays: calls are padded up to a few sizes, so a handful of graphs serves any
batch (padded rows and frames are masked, hence exact on the real ones)."""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generic, Optional, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
EntryT = TypeVar("EntryT")  # what a set of graphs keeps per bucket
BuffersT = TypeVar("BuffersT")  # the static buffers of a set of graphs
InputsT = TypeVar("InputsT")  # a bucket's static inputs
OutputsT = TypeVar("OutputsT")  # a captured pass's outputs
Grid = tuple[int, int, int]  # (rows, new frames, history frames) of a padded call


class GridBuckets(Protocol):
    """The buckets of a set of solver-step graphs (`SolverStepGraphs`): a call's bucket, and all of them."""

    def fit(self, rows: int, frames: int, history: int) -> Optional[Grid]: ...

    def shapes(self) -> list[Grid]: ...


def batch_bucket(batch: int) -> int:
    """1, 2, 4, 8, then multiples of 8."""
    return 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8


def row_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `largest`, then `largest` itself: the row counts of a set of graphs that serves calls of
    up to `largest` rows."""
    return tuple(1 << i for i in range((largest - 1).bit_length()) if 1 << i < largest) + (largest,)


def fitting_first(items: Sequence[T], fits: Callable[[T], bool]) -> list[list[T]]:
    """`items` as the passes of a call: those that fit a CUDA-graph bucket, then those that do not (each group only
    where it has any). A call is padded to its longest row, so one row beyond every bucket (an offline utterance, a
    history past the longest bucket) would otherwise take the whole call off the graphs."""
    inside: list[T] = []
    outside: list[T] = []
    for item in items:  # `fits` once per item: it looks up buckets
        (inside if fits(item) else outside).append(item)
    return [group for group in (inside, outside) if group]


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


def attention_cost(shape: Sequence[int]) -> int:
    """rows x new x (new + history) of a (rows, new frames, history frames) bucket: the size of its attention,
    which grows fastest with the bucket."""
    rows, new, history = shape
    return rows * new * (new + history)


def costliest_first(sizes: Sequence[Sequence[int]],
                    cost: Callable[[tuple[int, ...]], int] = math.prod) -> list[tuple[int, ...]]:
    """Every bucket of a grid (one size of each dimension), the costliest first, then the larger: captured in this
    order, a smaller graph reuses the pool blocks a larger one freed (the pool does not grow)."""
    return sorted(itertools.product(*sizes), key=lambda shape: (cost(shape), shape), reverse=True)


def concrete_device(device: "torch.device") -> "torch.device":
    """`cuda` -> `cuda:<current device>`. A tensor's device always carries an index, so an index-less device
    never compares equal to it: a cache keyed on the device would be rebuilt on every call."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


#: The worker threads whose graphs a process replays, each on its own CUDA stream (`speech_serving.cuda_streams`):
#: the LLM decoder's step graphs, and everything token2wav replays (flow solver and step graphs, encoder and vocoder
#: graphs, one after another on one stream). Their graphs are captured on one capture stream per worker (below).
LLM_GRAPHS = "llm"
TOKEN2WAV_GRAPHS = "token2wav"


def capture(run: Callable[[], T], device: "torch.device", pool: object,
            worker: str = TOKEN2WAV_GRAPHS) -> tuple["torch.cuda.CUDAGraph", T]:
    """`run` (static shapes, no host syncs) captured into a new CUDA graph in `pool`, on `worker`'s capture stream;
    returns the graph and the outputs of the captured call, which each replay overwrites.

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
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device, worker),
                              capture_error_mode="thread_local"):
            outputs = run()
    return graph, outputs


def capture_stream(device: "torch.device", worker: str) -> "torch.cuda.Stream":
    """The side stream of `device` that `worker`'s graphs are captured on, one per (GPU, worker).

    One per GPU: `torch.cuda.graph` otherwise captures on one stream it creates once per process on whatever device
    is current then, and with the tensors on another GPU (an instance on GPU 1 of a process whose current device is
    0) the capture runs on the wrong device and is invalidated. One per worker: cuBLAS and cuBLASLt bind their
    workspace to the (thread's handle, stream) a GEMM is issued on, and a graph keeps the workspace it was captured
    with. Graphs of two workers captured on one stream would share one workspace while their workers replay them at
    the same time on two streams: split-K GEMMs of both then write the same partial sums and wait on the same flags
    (wrong results, or kernels that spin). Graphs of one worker replay one after another and may share it."""
    import torch

    device = concrete_device(device)
    key = (device.index, worker)
    stream = _CAPTURE_STREAMS.get(key)
    if stream is None:
        # `torch.cuda.Stream` hands out a pool of streams round robin: two objects may wrap one CUDA stream
        taken = {other.cuda_stream for (index, _), other in _CAPTURE_STREAMS.items() if index == device.index}
        stream = torch.cuda.Stream(device)
        while stream.cuda_stream in taken:
            stream = torch.cuda.Stream(device)
        _CAPTURE_STREAMS[key] = stream
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


@dataclass(eq=False)
class CapturedBucket(Generic[InputsT, OutputsT]):
    """One bucket of a set of graphs: its static inputs (views of the set's buffers, or its own small tensors), its
    graph and the outputs every replay overwrites; graph and outputs are None where nothing was captured (a CPU
    device, or emulation: the pass then runs eagerly on the static inputs)."""

    inputs: InputsT
    graph: Optional["torch.cuda.CUDAGraph"]
    outputs: Optional[OutputsT]


class BucketGraphs(Generic[EntryT, BuffersT]):
    """What every set of CUDA graphs of one pass, one graph per shape bucket, keeps: per bucket an `EntryT` (in
    `_captured`), the static buffers (`BuffersT`) that the buckets' inputs view, allocated once for the largest
    bucket, the memory pool all its graphs share, and the lock that orders filling the static inputs and replaying.
    A subclass owns its buffers, its inputs and its pass. `emulate` (tests): pad to the buckets and use the static
    buffers on any device, running the pass eagerly instead of replaying."""

    def __init__(self, lock: "threading.Lock | threading.RLock") -> None:
        self._captured: dict[tuple[int, ...], EntryT] = {}
        self._buffers: Optional[BuffersT] = None
        self._pool: object | None = None
        self._lock = lock
        self.emulate = False

    def clear(self) -> None:
        """Drop every graph and buffer (after a failed capture: every call then runs eagerly)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        """Caller holds the lock. The pool goes with the graphs: a pool whose graphs are all gone must not take a new
        capture (the caching allocator asserts), so the next capture starts a new one."""
        self._captured.clear()
        self._buffers = None
        self._pool = None

    def _capture(self, run: Callable[[], T], device: "torch.device") -> tuple["torch.cuda.CUDAGraph", T]:
        """`capture` into this set's pool (started by the first capture)."""
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture(run, device, self._pool)


class GridGraphs(BucketGraphs[CapturedBucket[InputsT, OutputsT], BuffersT]):
    """Graphs per (rows, new frames, history frames) bucket of a grid (`sizes`, each dimension ascending). A bucket
    is captured on its first call on a CUDA device, or with every other one by `capture_all`; on another device it
    gets its static inputs only. A subclass gives the grid, its static buffers (`_allocate`), a bucket's own inputs
    (`_inputs`) and the pass over them (`_pass`)."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())

    def sizes(self) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
        raise NotImplementedError

    def bucket(self, rows: int, new: int, history: int) -> Optional[Grid]:
        """The padded (rows, new, history) of a call, or None (run eagerly) when it fits none."""
        return fit((rows, new, history), self.sizes())  # type: ignore[return-value]

    def buckets(self) -> list[Grid]:
        """Every bucket, the costliest first (`costliest_first`)."""
        return costliest_first(self.sizes(), attention_cost)  # type: ignore[return-value]

    def capture_all(self, device: "torch.device", dtype: "torch.dtype") -> int:
        """Capture every bucket now (a server does this before it reports ready); returns how many were new."""
        before = len(self._captured)
        for shape in self.buckets():
            with self._lock:
                self._get(shape, device, dtype)
        return len(self._captured) - before

    def _get(self, shape: Grid, device: "torch.device", dtype: "torch.dtype") -> CapturedBucket[InputsT, OutputsT]:
        """The bucket's static inputs and graph, captured now if it is new and `device` a GPU. Caller holds the
        lock."""
        import torch

        captured = self._captured.get(shape)
        if captured is not None:
            return captured
        if self._buffers is None:  # zeroed: padding must hold finite values (it is masked)
            self._buffers = self._allocate(device, dtype)
        inputs = self._inputs(shape, device, dtype)
        graph, outputs = None, None
        if device.type == "cuda":
            run = self._pass(shape, inputs)
            with torch.inference_mode():
                graph, outputs = self._capture(run, device)
        captured = self._captured[shape] = CapturedBucket(inputs, graph, outputs)
        return captured

    def _allocate(self, device: "torch.device", dtype: "torch.dtype") -> BuffersT:
        raise NotImplementedError

    def _inputs(self, shape: Grid, device: "torch.device", dtype: "torch.dtype") -> InputsT:
        raise NotImplementedError

    def _pass(self, shape: Grid, inputs: InputsT) -> Callable[[], OutputsT]:
        raise NotImplementedError


class SolverStepGraphs(BucketGraphs[CapturedBucket[InputsT, OutputsT], BuffersT]):
    """Graphs of one solver step per (rows, new frames, history frames) bucket of `buckets`, replayed once per step
    of a solve. The static buffers follow the calls: allocated on the device and dtype of the first capture or
    emulated call, and reallocated (every graph of the old ones dropped, with their pool) when a call comes on
    another. A bucket's inputs are made on its first call and its graph captured by `capture_all` (a call only
    replays what was captured). `lock` is reentrant: a whole solve holds it (static buffers, and graph outputs that
    the next replay overwrites) around the step calls that take it again. A subclass gives the buffers
    (`_allocate`, `_placement`), a bucket's static inputs and outputs (`_static`) and the step over them (`_pass`)."""

    def __init__(self, buckets: GridBuckets) -> None:
        super().__init__(threading.RLock())
        self.buckets = buckets

    @property
    def lock(self) -> "threading.RLock":
        return self._lock  # type: ignore[return-value]

    @property
    def captured(self) -> int:
        return sum(entry.graph is not None for entry in self._captured.values())

    def bucket(self, rows: int, frames: int, history: int, like: "torch.Tensor") -> Optional[Grid]:
        """The bucket a call of `like`'s device and dtype replays, or None (eager): it must fit a bucket that was
        captured for that device and dtype (any bucket when emulating)."""
        shape = self.buckets.fit(rows, frames, history)
        if shape is None or self.emulate:
            return shape
        entry, buffers = self._captured.get(shape), self._buffers  # a bucket's tensors live on the current buffers
        if entry is None or entry.graph is None or buffers is None or not like.is_cuda:
            return None
        return shape if self._placement(buffers) == (like.device, like.dtype) else None

    def capture_all(self, device: "torch.device", dtype: "torch.dtype") -> int:
        """Capture every bucket now (before a server reports ready), on `device` (any GPU, not only the current
        one), the costliest first; returns how many graphs were captured."""
        import torch

        before = self.captured
        device = concrete_device(device)
        with self.lock, torch.inference_mode():
            for shape in self.buckets.shapes():
                self._entry(shape, device, dtype, capture_graph=True)
        return self.captured - before

    def _replay(self, entry: CapturedBucket[InputsT, OutputsT]) -> OutputsT:
        """One step on the bucket's static inputs (filled by the caller, who holds the lock): replayed, or run
        eagerly when nothing was captured (emulation)."""
        if entry.graph is None:
            return self._pass(entry.inputs, entry.outputs)()
        entry.graph.replay()
        assert entry.outputs is not None
        return entry.outputs

    def _entry(self, shape: Grid, device: "torch.device", dtype: "torch.dtype",
               capture_graph: bool) -> CapturedBucket[InputsT, OutputsT]:
        """The bucket's static inputs on `device` and `dtype`, made now if new there (and its graph captured when
        `capture_graph` and `device` is a GPU). Caller holds the lock."""
        entry = self._captured.get(shape)  # every entry is made on the current buffers and goes when they do
        on_buffers = self._buffers is not None and self._placement(self._buffers) == (device, dtype)
        if entry is not None and on_buffers:
            if entry.graph is not None or not capture_graph:
                return entry
        device = concrete_device(device)
        if self._buffers is None or self._placement(self._buffers) != (device, dtype):
            self._clear()  # the graphs of the old buffers go, and with them their pool; freed before allocating
            self._buffers = self._allocate(device, dtype)
        inputs, outputs = self._static(shape, self._buffers)
        graph = None
        if capture_graph and device.type == "cuda":
            graph, outputs = self._capture(self._pass(inputs, outputs), device)
        entry = self._captured[shape] = CapturedBucket(inputs, graph, outputs)
        return entry

    def _allocate(self, device: "torch.device", dtype: "torch.dtype") -> BuffersT:
        raise NotImplementedError

    def _placement(self, buffers: BuffersT) -> tuple["torch.device", "torch.dtype"]:
        """The device and dtype `buffers` were allocated for."""
        raise NotImplementedError

    def _static(self, shape: Grid, buffers: BuffersT) -> tuple[InputsT, Optional[OutputsT]]:
        """A bucket's static inputs (on `buffers`), and its outputs when they are static tensors too (None: the
        captured step's own outputs)."""
        raise NotImplementedError

    def _pass(self, inputs: InputsT, outputs: Optional[OutputsT]) -> Callable[[], OutputsT]:
        """The step over a bucket's static inputs (static shapes, no host syncs: what a graph captures)."""
        raise NotImplementedError


Layout = dict  # name -> (dims, dtype): a bucket's static tensors, its inputs then its outputs (`PaddedCallGraphs`)


class PrefixBuffers:
    """The static inputs and outputs of every graph of a `PaddedCallGraphs`: one flat buffer per tensor name, sized
    for its largest bucket, each bucket's tensor a contiguous view of its start. All graphs read and write the same
    memory (replays run one at a time), so it is held once, not once per graph."""

    def __init__(self, layouts: "Sequence[Layout]", device: "torch.device") -> None:
        import torch

        self.device = device
        self._flat = {name: torch.zeros(size, device=device, dtype=dtype)
                      for name, (size, dtype) in self.sizes(layouts).items()}

    @staticmethod
    def sizes(layouts: "Sequence[Layout]") -> "dict[str, tuple[int, torch.dtype]]":
        """Per name the elements of its flat buffer (its largest bucket's tensor) and its dtype."""
        sizes: dict = {}
        for layout in layouts:
            for name, (dims, dtype) in layout.items():
                sizes[name] = (max(sizes.get(name, (0,))[0], math.prod(dims)), dtype)
        return sizes

    def views(self, layout: Layout) -> tuple["torch.Tensor", ...]:
        """A bucket's static tensors, in `layout`'s order."""
        return tuple(self._flat[name][:math.prod(dims)].view(dims) for name, (dims, _) in layout.items())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())


def fill(static: "torch.Tensor", value: "torch.Tensor") -> None:
    """`static` = `value` zero-padded at the end of every dimension."""
    if static.shape != value.shape:
        static.zero_()
    static[tuple(slice(0, n) for n in value.shape)].copy_(value)


class PaddedCallGraphs(BucketGraphs["torch.cuda.CUDAGraph", PrefixBuffers]):
    """Graphs of one whole pass (a vocoder call), one per bucket of a padded call's shape, all captured at once
    (`capture_all`, before a server reports ready) on the device they are given, none while serving: a call that
    fits no captured bucket runs eagerly and is counted (`eager_calls`). The graphs share one memory pool and the
    static buffers (`PrefixBuffers`); a lock orders the replays of threads, `ReplayOrder` those of CUDA streams.
    `emulate` (tests) runs the padded path - the static buffers, each bucket's pass - eagerly on any device.

    A subclass gives the buckets (`buckets`, whose `shapes()` lists them), a bucket's static tensors (`_layout`: its
    inputs, then its `outputs` last ones) and the pass over its inputs (`_pass`: static shapes, no host syncs);
    `replay` fills the inputs, replays and reads the outputs out."""

    outputs = 1  # how many of a layout's tensors, the last ones, a pass writes

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self._order = ReplayOrder()
        self.replayed_calls = 0  # calls replayed (emulated) from a bucket
        self.eager_calls = 0  # calls that fit no captured bucket

    def shapes(self) -> "list[tuple[int, ...]]":
        """Every bucket (the subclass's `buckets`), the costliest first: a smaller capture then reuses the pool blocks
        a larger one freed."""
        return self.buckets.shapes()  # type: ignore[attr-defined]

    def _layout(self, shape: tuple[int, ...], dtype: "torch.dtype") -> Layout:
        raise NotImplementedError

    def _pass(self, shape: tuple[int, ...]) -> "Callable[..., Sequence[torch.Tensor]]":
        raise NotImplementedError

    @property
    def count(self) -> int:
        """Graphs captured."""
        return len(self._captured)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the static input and output buffers (0 before the capture)."""
        return self._buffers.nbytes if self._buffers is not None else 0

    def planned_bytes(self, dtype: "torch.dtype") -> int:
        """Bytes the static buffers of these buckets take once allocated (at the capture), from the shapes alone."""
        sizes = PrefixBuffers.sizes([self._layout(shape, dtype) for shape in self.shapes()])
        return sum(size * dtype.itemsize for size, dtype in sizes.values())

    def capture_all(self, device: "torch.device", dtype: "Optional[torch.dtype]" = None) -> int:
        """Capture every bucket now, on `device` (the model's own, any GPU), the costliest first into one pool, with
        floating-point buffers of `dtype` (default fp32: the vocoders run in fp32); returns how many were new."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        device = concrete_device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not self.shapes():
            return 0
        with self._lock, torch.inference_mode():
            before = len(self._captured)
            buffers = self._buffers_on(device, dtype)
            for shape in self.shapes():
                if shape not in self._captured:
                    self._captured[shape], _ = self._capture(self._forward(shape, buffers, dtype), device)
            return len(self._captured) - before

    def replays_on(self, device: "torch.device") -> bool:
        """Whether a call on `device` may replay (emulating, or graphs captured there)."""
        return self.emulate or bool(self._captured and self._buffers is not None and self._buffers.device == device)

    def replay(self, shape: Optional[tuple[int, ...]], inputs: "Sequence[torch.Tensor]",
               read: "Callable[[tuple[torch.Tensor, ...]], T]") -> Optional[T]:
        """The pass of bucket `shape` over `inputs` (each zero-padded into its static tensor): replayed from its graph
        (emulation: run eagerly on the static tensors) and its outputs given to `read`, which must copy what it keeps
        (the next replay overwrites them); None, counted in `eager_calls`, when the call fits no captured bucket on
        its device: the caller runs it eagerly."""
        like = inputs[0]
        with self._lock:
            buffers = self._buffers_for(shape, like.device, like.dtype)
            if buffers is None or shape is None:
                self.eager_calls += 1
                return None
            self.replayed_calls += 1
            views = buffers.views(self._layout(shape, like.dtype))
            graph = self._captured.get(shape)
            device = buffers.device
            with on_device(device):
                if graph is not None:
                    self._order.wait(device)
                for static, value in zip(views, inputs):
                    fill(static, value)
                if graph is not None:
                    graph.replay()
                else:
                    self._forward(shape, buffers, like.dtype)()
                result = read(views[len(views) - self.outputs:])
                if graph is not None:
                    self._order.record(device)
            return result

    def _buffers_on(self, device: "torch.device", dtype: "torch.dtype") -> PrefixBuffers:
        """The static buffers on `device`; new ones drop the graphs that read the old. Caller holds the lock."""
        if self._buffers is None or self._buffers.device != device:
            self._clear()
            self._buffers = PrefixBuffers([self._layout(shape, dtype) for shape in self.shapes()], device)
        return self._buffers

    def _buffers_for(self, shape: Optional[tuple[int, ...]], device: "torch.device",
                     dtype: "torch.dtype") -> Optional[PrefixBuffers]:
        """The static buffers a call of bucket `shape` on `device` replays with, or None: it runs eagerly. Caller
        holds the lock."""
        if shape is None:
            return None
        if self.emulate:
            return self._buffers_on(device, dtype)
        if shape in self._captured and self._buffers is not None and self._buffers.device == device:
            return self._buffers
        return None

    def _forward(self, shape: tuple[int, ...], buffers: PrefixBuffers, dtype: "torch.dtype") -> Callable[[], None]:
        """One bucket's pass over its static inputs, its results copied into its static outputs (so the graph's own
        outputs are pool memory that the next capture may reuse)."""
        views = buffers.views(self._layout(shape, dtype))
        inputs, outputs = views[:len(views) - self.outputs], views[len(views) - self.outputs:]
        run = self._pass(shape)

        def forward() -> None:
            for out, result in zip(outputs, run(*inputs), strict=True):
                out.copy_(result)

        return forward
