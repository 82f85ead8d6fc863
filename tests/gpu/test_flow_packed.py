"""Packed rows (`cosyvoice2.flow.packed`) on CUDA, on the machine's last GPU (not the current device).

The attention pieces as one variable-length flash attention call (pieces of one row share their keys in place,
each seeing `seqused_k` of them) against the same visibility as an explicit mask, also replayed from a CUDA graph
after the index tensors changed; then whole calls of staggered streams replayed from the packed graphs in bf16
against the same calls eager in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cosyvoice2.flow import FlowConfig
from cosyvoice2.flow.cached import CachedFlowRunner, CachedRow, CachedSegment
from cosyvoice2.flow.packed import PackedLayout, piece_attention
from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2.testing.models import tiny_config
from tests.gpu.test_flow_cache import random_flow, stream_inputs

HEADS, HEAD_DIM, CHUNK = 8, 64, 50


FRAMES, KEYS, ROWS = 512, 1536, 6  # the axes of one graph, large enough for both layouts below


def graph_layout(device: torch.device, news, hists, finals) -> PackedLayout:
    frames, keys, rows = FRAMES, KEYS, ROWS
    return PackedLayout.of(news, hists, finals, [0] * len(news), CHUNK, device, frames=frames, keys=keys, rows=rows,
                           pieces=PackedLayout.pieces_for(frames, rows, CHUNK))


def reference(q, k, v, layout: PackedLayout) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=layout.visible())
    return out[0].transpose(0, 1)


def test_flash_pieces_equal_the_pieces_as_a_mask_and_replay_from_a_graph(gpus) -> None:
    device = torch.device("cuda", gpus - 1)
    gen = torch.Generator(device=device).manual_seed(0)
    layouts = [graph_layout(device, [100, 37, 200], [150, 0, 400], [False, True, False]),
               graph_layout(device, [250, 60], [50, 700], [False, False])]
    q = torch.randn(2 * FRAMES, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
    k = torch.randn(2 * KEYS, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
    v = torch.randn(2 * KEYS, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
    for layout in layouts:
        out = piece_attention(q, k, v, layout.index())
        assert out.shape == q.shape and out.device == device
        assert (out.float() - reference(q, k, v, layout)).abs().max().item() < 2e-2
    # a graph captured with the first layout's index tensors replays the second's once they are copied in
    static = layouts[0].index()
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            piece_attention(q, k, v, static)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = piece_attention(q, k, v, static)
        for name in ("cu_queries", "piece_keys", "piece_used"):
            getattr(static, name).copy_(getattr(layouts[1], name))
        graph.replay()
        torch.cuda.synchronize(device)
    assert (out.float() - reference(q, k, v, layouts[1])).abs().max().item() < 2e-2


@torch.inference_mode()
def staggered_calls(runner: CachedFlowRunner, flow, prompt_tokens: int, tokens: int, streams: int):
    """The mels of streams run in staggered rounds (stream s runs chunk i in round i + s, the last chunk final)."""
    prompt, prompt_mel, xvector, speech = stream_inputs(flow, prompt_tokens, tokens, streams)
    chunks = list(ChunkSchedule(prompt_tokens=prompt_tokens).chunks(tokens))
    dtype = next(flow.parameters()).dtype
    spks = runner.project_speaker(xvector.to(dtype))[0]
    prefix = runner.prefix(prompt, prompt_mel.to(dtype), spks)
    owns = [CachedSegment() for _ in range(streams)]
    mels = []
    for round_ in range(len(chunks) + streams - 1):
        work = [(s, chunks[round_ - s]) for s in range(streams) if 0 <= round_ - s < len(chunks)]
        rows = [CachedRow(torch.cat([prompt, speech[s][: c.feed]]), prompt_mel.to(dtype), spks, prefix, owns[s],
                          stop=prompt_tokens + c.stop, final=c.final, keep=not c.final,
                          emit_from=prompt_tokens + c.start) for s, c in work]
        mels.extend(runner.run(rows))
    return mels


@pytest.mark.parametrize("config", [tiny_config().flow, pytest.param(FlowConfig(), marks=pytest.mark.slow)],
                         ids=["tiny", "released"])
@pytest.mark.parametrize(("max_rows", "streams"), [(None, 3), (32, 20)], ids=["3-streams", "20-streams-rows-32"])
def test_packed_graphs_in_bf16_follow_the_fp32_calls(gpus, config, max_rows, streams, no_tf32) -> None:
    """The packed CUDA graphs (bf16: flash attention pieces, replayed with each call's index tensors) against the
    same calls eager in fp32 (the pieces as a mask), on the last GPU; also calls of more than 16 rows, with the
    graphs of `--token2wav-rows 32`."""
    device = torch.device("cuda", gpus - 1)
    reference_flow = random_flow(config, device)
    reference = staggered_calls(CachedFlowRunner(reference_flow), reference_flow, prompt_tokens=60, tokens=250,
                                streams=streams)
    flow = copy.deepcopy(reference_flow).bfloat16()
    flow.decoder.rand_noise = flow.decoder.rand_noise.float()  # as loaded for serving: noise cast per call
    runner = CachedFlowRunner(flow, max_rows=max_rows)
    assert runner.solve_graphs.capture_all(device, torch.bfloat16) > 0
    replayed = staggered_calls(runner, flow, prompt_tokens=60, tokens=250, streams=streams)
    # the calls replayed graphs: their frames were padded up to the frame buckets (eager calls pad nothing)
    assert runner.frames_computed > runner.frames_needed
    scale = max(a.abs().max().item() for a in reference)
    for a, b in zip(reference, replayed):
        assert a.shape == b.shape and (a - b.float()).abs().max().item() <= 0.05 * scale
