"""CosyVoice3's flow step graphs (`cosyvoice3.graphs`): a batched flow solve padded to a (rows, new frames,
history frames) bucket gives every row what the unpadded eager solve gives it (mel, caches, audio), a call outside
the buckets runs eagerly, and the buckets of an engine's schedule cover every non-final chunk its streams form. On
the CPU the buckets run emulated (static buffers and padding, each pass run eagerly); tests/gpu/test_cosyvoice3_graphs.py
replays captured graphs on CUDA. CPU, fp32, the tiny random model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from cosyvoice3.graphs import FlowGraphBuckets, FlowStepGraphs, chunk_frame_limits
from cosyvoice3.token2wav import CosyVoice3Token2Wav, runtime_schedule
from tests.cosyvoice3.conftest import (AUDIO_OF_SCALE, MEL_ATOL, Rounds, make_voice, open_stream, run_rounds,
                                      stream_tokens)

# small buckets for the tiny model: every dimension of the test calls gets padded, and some calls fit none
BUCKETS = FlowGraphBuckets(rows=(1, 2, 4), frames=(96, 112, 160), history=(64, 128, 256))


@dataclass(frozen=True)
class Plan:
    prompt: int  # prompt tokens
    tokens: int
    first_round: int = 0
    seed: int = 0


MIXES = {
    # a voice cache of nothing (short prompt), of two chunks (long prompt); streams joining late; one stream whose
    # history outgrows the largest history bucket and chunks that outgrow the largest frame bucket (eager calls)
    "three streams pad to four rows": [Plan(20, 90, seed=1), Plan(56, 70, first_round=1, seed=2),
                                       Plan(9, 40, seed=3)],
    "one stream": [Plan(56, 120, seed=4)],
    "five rows, more than the largest row bucket": [Plan(20 + 7 * i, 50 + 9 * i, first_round=i // 3, seed=10 + i)
                                                    for i in range(5)],
}


def recording(graphs: FlowStepGraphs) -> list[tuple[tuple[int, int, int], object]]:
    """Record every (rows, new frames, history) a solve asks `graphs` for, with the bucket it got."""
    calls: list = []
    bucket = graphs.bucket

    def wrapped(rows: int, frames: int, history: int, like: torch.Tensor):
        shape = bucket(rows, frames, history, like)
        calls.append(((rows, frames, history), shape))
        return shape

    graphs.bucket = wrapped  # type: ignore[method-assign]
    return calls


def run_plans(token2wav: CosyVoice3Token2Wav, plans: list[Plan], graphs: FlowStepGraphs | None) -> Rounds:
    """Every stream of `plans`, cached, one chunk of each live stream per `run_chunks` call, on `graphs`."""
    token2wav.graphs = graphs  # type: ignore[assignment]
    streams = [open_stream(token2wav, make_voice(plan.seed, plan.prompt), stream_tokens(plan.seed, plan.tokens))
               for plan in plans]
    return run_rounds(token2wav, streams, [plan.first_round for plan in plans])


@pytest.mark.parametrize("name", sorted(MIXES))
def test_emulated_buckets_give_the_eager_mel_caches_and_audio(token2wav: CosyVoice3Token2Wav, name: str) -> None:
    plans = MIXES[name]
    saved = token2wav.graphs
    try:
        eager = run_plans(token2wav, plans, None)
        graphs = FlowStepGraphs(token2wav.flow.estimator, BUCKETS)
        graphs.emulate = True
        calls = recording(graphs)
        counted = dataclasses.replace(token2wav.frame_counts)
        padded = run_plans(token2wav, plans, graphs)
    finally:
        token2wav.graphs = saved
    assert any(shape is not None for _, shape in calls), "no call was padded to a bucket"
    assert any(shape is None for _, shape in calls) or name == "one stream"
    for (rows, frames, history), shape in calls:
        assert shape is None or (shape[0] >= rows and shape[1] >= frames and shape[2] >= history)
    # the frames counted (the served flow-padding share): each solve's rows x new frames, padded to its bucket
    computed = token2wav.frame_counts.computed - counted.computed
    needed = token2wav.frame_counts.needed - counted.needed
    assert computed == sum(shape[0] * shape[1] if shape else rows * frames for (rows, frames, _), shape in calls)
    assert 0 < needed < computed  # every mix pads some solve to a bucket
    for stream in range(len(plans)):
        for a, b in zip(eager.mels[stream], padded.mels[stream], strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(b, a, rtol=0, atol=MEL_ATOL)
        ours, theirs = np.concatenate(padded.pieces[stream]), np.concatenate(eager.pieces[stream])
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=AUDIO_OF_SCALE * float(np.abs(theirs).max()))
        for a, b in zip(eager.caches[stream], padded.caches[stream], strict=True):
            assert a.committed == b.committed
            for x, y in zip([*a.kv, *a.context], [*b.kv, *b.context], strict=True):
                torch.testing.assert_close(y, x, rtol=0, atol=MEL_ATOL)


@pytest.mark.parametrize("hops", [(15, 25), (10, 20)])
def test_the_buckets_cover_every_non_final_chunk_of_the_schedule(token2wav: CosyVoice3Token2Wav, hops) -> None:
    """Streams of prompts across the chunk boundaries (no voice cache, one just before / after a boundary, long),
    cut by the schedule: every non-final chunk's solve fits the buckets of `graph_buckets([schedule])` while its
    history fits the largest history bucket and its hop the largest frame bucket."""
    schedule = runtime_schedule(*hops, lookahead=token2wav.lookahead)
    buckets = token2wav.graph_buckets([schedule])
    limits = chunk_frame_limits(schedule, token2wav.flow.config.token_mel_ratio,
                                token2wav.flow.estimator.config.static_chunk_size)
    assert buckets.frames[-1] >= max(limits) and len(buckets.frames) == len(limits) >= 5
    saved, saved_schedule = token2wav.graphs, token2wav.schedule
    try:
        token2wav.schedule = schedule
        graphs = FlowStepGraphs(token2wav.flow.estimator, buckets)
        graphs.emulate = True
        calls = recording(graphs)
        plans = [Plan(p, 2 * sum(hops) + 60, seed=p) for p in (2, 4, 27, 28, 29, 52, 80)]
        for plan in plans:  # alone: one call per chunk, so each chunk's own shape is seen
            run_plans(token2wav, [plan], graphs)
    finally:
        token2wav.graphs, token2wav.schedule = saved, saved_schedule
    # the solves within the frame limits: every non-final chunk's (and the final chunks' as short as those)
    streaming = [(call, shape) for call, shape in calls if call[1] <= limits[-1]]
    assert len(streaming) >= len(plans) * 3
    for (rows, frames, history), shape in streaming:
        if history <= buckets.history[-1]:
            assert shape is not None, (rows, frames, history)


def test_calls_beyond_the_buckets_and_uncaptured_buckets_run_eagerly(token2wav: CosyVoice3Token2Wav) -> None:
    buckets = token2wav.graph_buckets([token2wav.schedule])
    assert buckets.fit(max(buckets.rows) + 1, 10, 10) is None
    assert buckets.fit(1, buckets.frames[-1] + 1, 10) is None
    assert buckets.fit(1, 10, buckets.history[-1] + 1) is None
    assert buckets.fit(3, 85, 1) == (4, buckets.frames[0], buckets.history[0])
    graphs = FlowStepGraphs(token2wav.flow.estimator, BUCKETS)
    like = torch.zeros(1)
    assert graphs.bucket(2, 90, 10, like) is None  # nothing captured, not emulating
    assert graphs.capture_all(torch.device("cpu"), torch.float32) == 0  # the CPU captures nothing
    assert graphs.bucket(2, 90, 10, like) is None
    assert graphs.static_bytes() > 0 and not graphs.captured
    graphs.clear()
    assert graphs.static_bytes() == 0


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_every_bucket_shares_the_static_buffers_the_plan_counts(token2wav: CosyVoice3Token2Wav) -> None:
    """Every bucket's window, mu, cond, history keys/values and outputs are views of the same few buffers, and those
    hold exactly what `plan` computes from the configuration (per-bucket outputs grew with the number of buckets)."""
    graphs = FlowStepGraphs(token2wav.flow.estimator, BUCKETS)
    assert graphs.capture_all(torch.device("cpu"), torch.float32) == 0
    assert graphs.static_bytes() == graphs.plan(torch.float32).total > 0
    like = torch.zeros(1)
    seen: dict[str, set[int]] = {}
    with torch.inference_mode():
        for shape in BUCKETS.shapes():
            inputs = graphs.inputs(shape, like)
            velocity, keys_values = graphs.run(shape)
            rows, frames, history = shape
            assert velocity.shape == (2 * rows, 80, frames) and keys_values.shape[2::2] == (2 * rows, frames)
            for name, tensor in dict(window=inputs.window, mu=inputs.mu, cond=inputs.cond, past=inputs.past,
                                     velocity=velocity, keys_values=keys_values).items():
                seen.setdefault(name, set()).add(storage(tensor))
    assert all(len(pointers) == 1 for pointers in seen.values()), seen
    assert len(set.union(*seen.values())) == len(seen)  # one buffer per name
    graphs.clear()
    assert graphs.static_bytes() == 0


#: What the served CosyVoice3 engine's step graphs may hold outside their pool at the released size in bf16. Beside
#: them on one 80 GB GPU: the engine's weights and LLM KV cache (about 4 GiB), the graph pool (one pass of the
#: largest bucket, about 1.5 GiB), the live streams' flow-cache budget (16 GiB by default), the kept voices' prompt
#: caches, and CosyVoice2's engine process (about 17 GiB).
RELEASED_STATIC_BOUND = 8 * 2**30


def test_the_released_size_step_graphs_plan_stays_bounded() -> None:
    """The released configuration's served buckets (the runtime schedule), allocated on the meta device (no
    memory): the buffers are what the plan says, and under the bound; 120 buckets with outputs of their own would
    have held over 40 GiB."""
    from cosyvoice3.config import CosyVoice3Config
    from cosyvoice3.flow import CosyVoice3Flow
    from cosyvoice3.hift import CausalHiFT

    config = CosyVoice3Config()
    with torch.device("meta"):
        flow, hift = CosyVoice3Flow(config.flow).to(dtype=torch.bfloat16), CausalHiFT(config.hift)
    engine = CosyVoice3Token2Wav(flow, hift, cache_budget_bytes=16 * 2**30)
    graphs = engine.graphs
    assert len(graphs.buckets.shapes()) == 120
    plan = graphs.plan(torch.bfloat16)
    assert graphs.capture_all(torch.device("meta"), torch.bfloat16) == 0
    assert graphs.static_bytes() == plan.total <= RELEASED_STATIC_BOUND, plan.describe()
    dit = config.flow.dit
    own_outputs = sum(dit.depth * 2 * 2 * rows * dit.inner_dim * frames * 2
                      for rows, frames, _ in graphs.buckets.shapes())
    assert own_outputs > 40 * 2**30 > 5 * plan.outputs
    described = engine.memory_plan()
    assert f"{plan.total / 2**30:.2f} GiB" in described and "16.00 GiB at most" in described, described
