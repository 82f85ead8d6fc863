"""The chunk-cached streaming flow (UNet, `cosyvoice2.flow.cached`) on CUDA: for streams of several chunks (one
voice; rows at different points of their streams packed in one call), the cached path's mel equals recomputing
prompt + history for every non-final chunk. In fp32 the packed solve runs eagerly (attention pieces as a mask); its
CUDA graphs (half precision) are checked in tests/gpu/test_flow_packed.py.

fp32 means fp32 here: TF32 is switched off, since cuDNN's TF32 convolutions alone differ by ~1e-3 between two call
shapes. The tiny flow checks the logic fast; the released-size one (marked slow) checks the real shapes."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.flow import CausalFlow, FlowConfig
from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2.testing.models import tiny_config

TOLERANCE = 5e-5  # fp32, absolute, on mel values of order 1-10


def random_flow(config: FlowConfig, device: torch.device) -> CausalFlow:
    torch.manual_seed(0)
    with torch.device(device):
        flow = CausalFlow(config).eval()
        for param in flow.parameters():  # default init plus offsets: no trivial norms
            param.data.add_(torch.randn_like(param) * 0.02)
    flow.decoder.rand_noise = flow.decoder.rand_noise.to(device)
    flow.decoder.cuda_graphs = None  # the reference recomputes eagerly
    return flow


def stream_inputs(flow: CausalFlow, prompt_tokens: int, tokens: int, streams: int):
    """(prompt tokens, prompt mel, x-vector, each stream's speech tokens) of one random voice, on the flow's device."""
    device = next(flow.parameters()).device
    gen = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randint(0, flow.config.vocab_size, (prompt_tokens,), device=device, generator=gen)
    prompt_mel = torch.randn(2 * prompt_tokens, 80, device=device, generator=gen)
    xvector = torch.randn(1, 192, device=device, generator=gen)
    speech = [torch.randint(0, flow.config.vocab_size, (tokens,), device=device, generator=gen)
              for _ in range(streams)]
    return prompt, prompt_mel, xvector, speech


@torch.inference_mode()
def worst_cached_deviation(flow: CausalFlow, prompt_tokens: int, tokens: int, streams: int) -> float:
    """max |cached - recompute| over every non-final chunk of every stream. Stream s runs chunk i in round i + s,
    so each call mixes rows at different points of their streams."""
    runner = CachedFlowRunner(flow)
    prompt, prompt_mel, xvector, speech = stream_inputs(flow, prompt_tokens, tokens, streams)
    chunks = [c for c in ChunkSchedule(prompt_tokens=prompt_tokens).chunks(tokens) if not c.final]
    spks = runner.project_speaker(xvector)[0]
    prefix = runner.prefix(prompt, prompt_mel, spks)
    owns = [CachedSegment() for _ in range(streams)]
    worst = 0.0
    for round_ in range(len(chunks) + streams - 1):
        work = [(s, chunks[round_ - s]) for s in range(streams) if 0 <= round_ - s < len(chunks)]
        rows = [CachedRow(torch.cat([prompt, speech[s][: c.feed]]), prompt_mel, spks, prefix, owns[s],
                          stop=prompt_tokens + c.stop, final=False, keep=True, emit_from=prompt_tokens + c.start)
                for s, c in work]
        for (s, c), mel in zip(work, runner.run(rows)):
            recomputed = flow.inference(speech[s][None, : c.feed], prompt[None], prompt_mel[None], xvector,
                                        streaming=True, finalize=False)[0, :, 2 * c.start :]
            assert mel.shape == recomputed.shape, (mel.shape, recomputed.shape)
            worst = max(worst, float((mel - recomputed.float()).abs().max()))
    return worst


def test_the_cached_flow_equals_recompute(gpus, no_tf32) -> None:
    flow = random_flow(tiny_config().flow, torch.device("cuda"))
    worst = worst_cached_deviation(flow, prompt_tokens=60, tokens=250, streams=3)
    assert worst <= TOLERANCE, worst


@pytest.mark.slow
def test_the_released_size_cached_flow_equals_recompute(gpus, no_tf32) -> None:
    flow = random_flow(FlowConfig(), torch.device("cuda"))
    worst = worst_cached_deviation(flow, prompt_tokens=150, tokens=400, streams=3)
    assert worst <= TOLERANCE, worst
