"""CUDA graphs of token2wav. The CFM's graph path pads a call to a frame bucket: the padded solve must equal the
unpadded one on the real frames (CPU). Graph replays of the CFM loop and of HiFT must equal eager runs (CUDA)."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.flow import CausalFlow
from cosyvoice2.hift import HiFTGenerator
from cosyvoice2.hift.generator import HiFTBuckets
from tests.engine.micro_modules import TINY_FLOW, TINY_HIFT, randomized


def flow_inputs(frames: int, prompt_frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(1, 80, frames, generator=gen)
    cond = torch.zeros(1, 80, frames)
    cond[:, :, :prompt_frames] = torch.randn(1, 80, prompt_frames, generator=gen)
    return mu, torch.ones(1, 1, frames), torch.randn(1, 80, generator=gen), cond


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.manual_seed(3)
    return randomized(lambda: CausalFlow(TINY_FLOW), seed=3)


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("frames", [70, 128, 131])
@torch.inference_mode()
def test_bucket_padding_leaves_real_frames_unchanged(flow: CausalFlow, frames: int, streaming: bool) -> None:
    cfm = flow.decoder
    inputs = flow_inputs(frames, prompt_frames=40, seed=frames)
    padded = cfm.cuda_graphs.pad(*inputs)
    assert padded[0].size(-1) == cfm.cuda_graphs.padded_frames(frames) >= frames
    reference = cfm.solve(*inputs, streaming)
    got = cfm.solve(*padded, streaming)[:, :, :frames]
    assert reference.abs().max() > 0.1
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_graph_replay_matches_eager_solve(flow: CausalFlow, dtype: torch.dtype) -> None:
    cfm = flow.to("cuda", dtype).decoder
    # fp32 without TF32 convolutions: the padded graph and the unpadded eager call pick different conv algorithms,
    # and TF32 alone puts them ~1e-3 apart (seen on an H200)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        # a shape's first call runs eagerly, its second captures and replays, the third replays
        for frames, streaming in [(131, True)] * 3 + [(90, False)] * 2 + [(250, True)]:
            inputs = [t.to("cuda", dtype) for t in flow_inputs(frames, prompt_frames=40, seed=frames)]
            eager = cfm.solve(*inputs, streaming).float()
            graph = cfm(*inputs, streaming)
            tol = 5e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(graph, eager, rtol=tol, atol=tol)
    flow.to("cpu", torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@torch.inference_mode()
def test_hift_graph_replays_match_eager_vocoding() -> None:
    torch.manual_seed(4)
    hift = randomized(lambda: HiFTGenerator(TINY_HIFT), seed=4).to("cuda")
    hift.cuda_graphs.use_buckets(HiFTBuckets(rows=(1,), frames=(32, 64), cache_samples=3840))
    assert hift.cuda_graphs.capture_all(torch.device("cuda")) == 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    # graphs run padded to a frame bucket: without TF32 convolutions, so that other conv algorithms for the padded
    # shape stay at fp32 rounding (as the CFM test)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for frames, cache in [(40, 0), (40, 0), (58, 3840), (58, 3840), (33, 0), (20, 3840)]:
            mel = torch.randn(1, 80, frames, device="cuda", generator=gen)
            noise = hift.draw_noise(1, frames, gen)
            cache_source = torch.randn(1, 1, cache, device="cuda", generator=gen)
            graphs, hift.cuda_graphs = hift.cuda_graphs, None
            eager = hift.inference(mel, cache_source, noise)
            hift.cuda_graphs = graphs
            replayed = hift.inference(mel, cache_source, noise)
            for got, want in zip(replayed, eager):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (hift.cuda_graphs.replayed_calls, hift.cuda_graphs.eager_calls) == (6, 0)
