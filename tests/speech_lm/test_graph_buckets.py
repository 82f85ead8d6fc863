"""The bookkeeping every set of bucketed CUDA graphs shares (`speech_lm.graph_buckets.GridGraphs`), on the CPU: the
capture itself is recorded instead of run (the GPU tests in tests/gpu capture for real), so what is checked is
which buckets are captured, in which order, on which device and into which pool, and what `clear` and a failed
capture leave behind."""

from __future__ import annotations

import pytest
import torch

from speech_lm import graph_buckets
from speech_lm.graph_buckets import GridGraphs, attention_cost, costliest_first


class _Recorded(GridGraphs[tuple, str, list]):
    """A grid whose pass is the bucket's name: nothing is allocated on a device."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[tuple[torch.device, torch.dtype]] = []

    def sizes(self):
        return (1, 2), (16, 32), (64, 128)

    def _allocate(self, device, dtype):
        self.allocated.append((device, dtype))
        return []

    def _inputs(self, shape, device, dtype):
        return shape

    def _pass(self, shape, inputs):
        return lambda: f"pass {inputs}"


class _Captures:
    """Each capture as (what ran, device, pool); a pass named in `fail` raises instead."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device, object]] = []
        self.fail: tuple[str, ...] = ()

    def __call__(self, run, device, pool):
        outputs = run()
        if outputs in self.fail:
            raise RuntimeError(f"capture of {outputs} failed")
        self.seen.append((outputs, device, pool))
        return f"graph of {outputs}", outputs


@pytest.fixture
def captures(monkeypatch) -> _Captures:
    pools = iter(range(100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: f"pool {next(pools)}")
    recorder = _Captures()
    monkeypatch.setattr(graph_buckets, "capture", recorder)
    return recorder


def test_every_bucket_is_captured_costliest_first_on_the_given_device_into_one_pool(captures) -> None:
    graphs = _Recorded()
    device = torch.device("cuda", 1)  # not the current device: it must reach the capture as it is
    assert graphs.capture_all(device, torch.float16) == 8
    order = [run for run, _, _ in captures.seen]
    assert order == [f"pass {shape}" for shape in graphs.buckets()]
    costs = [attention_cost(shape) for shape in graphs.buckets()]
    assert costs == sorted(costs, reverse=True) and graphs.buckets()[0] == (2, 32, 128)
    assert {(d, pool) for _, d, pool in captures.seen} == {(device, "pool 0")}
    assert graphs.allocated == [(device, torch.float16)]  # the static buffers once, for every bucket
    assert graphs.capture_all(device, torch.float16) == 0 and len(captures.seen) == 8  # nothing new
    entry = graphs._captured[(1, 16, 64)]
    assert (entry.graph, entry.outputs, entry.inputs) == ("graph of pass (1, 16, 64)", "pass (1, 16, 64)", (1, 16, 64))


def test_a_failed_capture_keeps_no_graph_and_clear_starts_over_with_a_new_pool(captures) -> None:
    graphs = _Recorded()
    device = torch.device("cuda", 0)
    captures.fail = ("pass (1, 32, 64)",)
    with pytest.raises(RuntimeError, match="failed"):
        graphs.capture_all(device, torch.float32)
    assert (1, 32, 64) not in graphs._captured and len(graphs._captured) == len(captures.seen) > 0
    graphs.clear()
    assert graphs._captured == {} and graphs._buffers is None and graphs._pool is None
    captures.fail, captures.seen = (), []
    assert graphs.capture_all(device, torch.float32) == 8
    assert {pool for _, _, pool in captures.seen} == {"pool 1"}  # a pool whose graphs are gone takes no new capture
    assert len(graphs.allocated) == 2


def test_on_the_cpu_a_bucket_gets_its_inputs_and_no_graph(captures) -> None:
    graphs = _Recorded()
    assert graphs.capture_all(torch.device("cpu"), torch.float32) == 8
    assert captures.seen == [] and graphs._pool is None
    assert all(entry.graph is None and entry.outputs is None for entry in graphs._captured.values())


def test_buckets_fit_the_smallest_size_of_each_dimension() -> None:
    graphs = _Recorded()
    assert graphs.bucket(2, 17, 0) == (2, 32, 64) and graphs.bucket(3, 1, 1) is None
    assert costliest_first(((1, 2), (3, 5))) == [(2, 5), (2, 3), (1, 5), (1, 3)]


class _PooledStream:
    """`torch.cuda.Stream` as PyTorch hands it out: objects wrapping a pool of a few CUDA streams, round robin."""

    POOL = 3
    handed_out = 0

    def __init__(self, device) -> None:
        self.device = device
        self.cuda_stream = 1000 + _PooledStream.handed_out % self.POOL
        _PooledStream.handed_out += 1


@pytest.fixture
def pooled_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _PooledStream)
    monkeypatch.setattr(graph_buckets, "_CAPTURE_STREAMS", {})
    _PooledStream.handed_out = 0
    return _PooledStream


def test_each_worker_captures_on_a_cuda_stream_of_its_own(pooled_streams) -> None:
    """The LLM's and token2wav's graphs replay at the same time: captured on one stream they would share cuBLAS's
    workspace. A worker keeps its stream; no two workers of a GPU get the same CUDA stream, even where the pool's
    round robin comes back to one already taken."""
    gpu = torch.device("cuda", 1)
    llm = graph_buckets.capture_stream(gpu, graph_buckets.LLM_GRAPHS)
    pooled_streams.handed_out = 0  # the pool comes round to the LLM's stream next
    token2wav = graph_buckets.capture_stream(gpu, graph_buckets.TOKEN2WAV_GRAPHS)
    assert llm.cuda_stream != token2wav.cuda_stream
    assert graph_buckets.capture_stream(gpu, graph_buckets.LLM_GRAPHS) is llm
    assert graph_buckets.capture_stream(gpu, graph_buckets.TOKEN2WAV_GRAPHS) is token2wav
    other_gpu = graph_buckets.capture_stream(torch.device("cuda", 0), graph_buckets.LLM_GRAPHS)
    assert other_gpu is not llm and other_gpu.device == torch.device("cuda", 0)


def test_fitting_first_runs_the_rows_beyond_every_bucket_apart():
    from speech_lm.graph_buckets import fitting_first

    assert fitting_first([3, 900, 5, 700], lambda n: n <= 256) == [[3, 5], [900, 700]]  # order kept within a pass
    assert fitting_first([3, 5], lambda n: n <= 256) == [[3, 5]]  # no empty pass
    assert fitting_first([900], lambda n: n <= 256) == [[900]]
    assert fitting_first([], lambda n: True) == []
