"""HiFT's CUDA graphs (`cosyvoice2.hift.generator.HiFTGraphs`) captured up front and replayed on the machine's last
GPU while GPU 0 is the current device (a Triton instance on GPU 1 of a process CUDA starts on GPU 0): each replay
gives the eager call's audio and source, nothing lands on GPU 0, and nothing is captured while calls run. TF32 is
off: fp32 compares fp32. The tiny HiFT with small buckets checks padding, the shared static buffers and the row
split fast; the released size (marked slow) captures every bucket a server captures for the served schedules.
tests/engine/test_hift_graphs.py checks the same padding emulated on the CPU."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from cosyvoice2.hift.generator import HiFTBuckets
from tests.engine.micro_modules import TINY_HIFT, randomized

OVERLAP = 8 * 480
TOLERANCE = 1e-4


@pytest.fixture
def last_gpu(gpus: int) -> torch.device:
    torch.cuda.set_device(0)  # what CUDA gives a new process
    return torch.device("cuda", gpus - 1)


def twins(config: HiFTConfig, device: torch.device, seed: int) -> tuple[HiFTGenerator, HiFTGenerator]:
    """An eager HiFT and one with graphs, same weights, on `device`."""
    eager = randomized(lambda: HiFTGenerator(config), seed=seed)
    graphed = HiFTGenerator(config).eval()
    graphed.load_state_dict(eager.state_dict())
    eager.cuda_graphs = None
    return eager.to(device), graphed.to(device)


@torch.inference_mode()
def compare(eager: HiFTGenerator, graphed: HiFTGenerator, device: torch.device,
            shapes: list[tuple[list[int], list[int]]], seed: int) -> float:
    """Worst |replayed - eager| over the calls' audio and source (the same noise drawn for both)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    worst = 0.0
    for frames, caches in shapes:
        mels = [torch.randn(1, 80, m, device=device, generator=gen) * 2 for m in frames]
        sources = [torch.randn(1, 1, c, device=device, generator=gen) * 0.5 if c else None for c in caches]
        noises = [eager.draw_noise(1, m, gen) for m in frames]
        want = eager.inference_batch(mels, sources, noises)
        got = graphed.inference_batch(mels, sources, noises)
        for (audio, source), (want_audio, want_source) in zip(got, want, strict=True):
            assert audio.device == device and audio.shape == want_audio.shape and source.shape == want_source.shape
            assert float(want_audio.abs().max()) > 0.05
            worst = max(worst, float((audio - want_audio).abs().max()), float((source - want_source).abs().max()))
    torch.cuda.synchronize(device)
    return worst


def test_replays_on_the_last_gpu_equal_eager_calls(last_gpu, no_tf32) -> None:
    eager, graphed = twins(TINY_HIFT, last_gpu, seed=4)
    graphs = graphed.cuda_graphs
    graphs.use_buckets(HiFTBuckets(rows=(1, 2, 4), frames=(32, 64, 112), cache_samples=OVERLAP))
    before = torch.cuda.memory_allocated(0)
    assert graphs.capture_all(last_gpu) == 9
    assert graphs.count == 9 and graphs.capture_all(last_gpu) == 0  # captured once
    shapes = [
        ([58], [0]),  # a first chunk
        ([108], [OVERLAP]),  # a second chunk, exactly after the withheld frames
        ([40, 21, 33], [OVERLAP, 0, OVERLAP]),  # 3 rows -> 4, 40 -> 64 frames
        ([64, 60, 50, 30], [OVERLAP] * 4),
        ([20, 12], [OVERLAP, 0]),  # after a larger call: the shared buffers hold its stale rows
        ([40, 300, 21], [OVERLAP, 0, 0]),  # an offline utterance beside chunks: it runs eagerly, they replay
        ([30] * 5, [0] * 5),  # more rows than any bucket: eager
    ]
    worst = compare(eager, graphed, last_gpu, shapes, seed=1)
    assert worst <= TOLERANCE, worst
    assert (graphs.replayed_calls, graphs.eager_calls, graphs.count) == (6, 2, 9)
    if last_gpu.index != 0:
        assert torch.cuda.memory_allocated(0) == before  # nothing of HiFT's graphs on GPU 0


def test_a_capture_that_fails_leaves_hift_eager(last_gpu, no_tf32, monkeypatch) -> None:
    """The server's handling (`speech_serving.engines.capture_hift_graphs`): logged, every call eager, same audio."""
    from speech_serving import engines

    eager, graphed = twins(TINY_HIFT, last_gpu, seed=5)
    graphed.cuda_graphs.use_buckets(HiFTBuckets(rows=(1, 2), frames=(64,), cache_samples=OVERLAP))

    def broken(*_args, **_kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr("speech_lm.graph_buckets.capture", broken)  # every graph set captures through it

    class Engine:  # what `capture_hift_graphs` reads of a token2wav engine
        hift, hift_device = graphed, last_gpu

        def capture_hift_graphs(self) -> int:
            return self.hift.cuda_graphs.capture_all(self.hift_device)

    assert engines.capture_hift_graphs(Engine()) == 0
    assert graphed.cuda_graphs.count == 0
    assert compare(eager, graphed, last_gpu, [([40], [OVERLAP])], seed=2) <= TOLERANCE
    assert graphed.cuda_graphs.eager_calls == 1


@pytest.mark.slow
def test_the_released_size_replays_every_served_bucket(last_gpu, no_tf32) -> None:
    """Every bucket a server captures for the served schedules (align_first_hop busy: aligned and unaligned first
    hops, every prompt length), at the released size; calls of 1, 3 and 16 rows at first-chunk, second-chunk,
    steady and final-chunk lengths replay and equal the eager ones."""
    from cosyvoice2.config import EngineConfig
    from cosyvoice2.hift.generator import FRAME_STEP
    from enginebench.hift_graphs import MAX_ROWS, served_buckets

    config = EngineConfig()
    eager, graphed = twins(HiFTConfig(), last_gpu, seed=6)
    graphs = graphed.cuda_graphs
    buckets = served_buckets(config, FRAME_STEP)
    graphs.use_buckets(buckets)
    started = torch.cuda.memory_reserved(last_gpu)
    assert graphs.capture_all(last_gpu) == len(buckets.shapes())
    print(f"{graphs.count} graphs, {(torch.cuda.memory_reserved(last_gpu) - started) / 2**20:.0f} MiB reserved")
    shapes = [([50], [0]), ([98] * 3, [0] * 3), ([108], [OVERLAP]), ([208] * MAX_ROWS, [OVERLAP] * MAX_ROWS),
              ([212, 14, 108], [OVERLAP] * 3), ([54, 208, 98] + [208] * 13, [0, OVERLAP, 0] + [OVERLAP] * 13)]
    assert compare(eager, graphed, last_gpu, shapes, seed=3) <= TOLERANCE
    assert (graphs.replayed_calls, graphs.eager_calls) == (len(shapes), 0)
