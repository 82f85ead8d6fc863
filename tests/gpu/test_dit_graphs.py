"""The DiT flow's step graphs (`cosyvoice2.dit.graphs`) replayed on CUDA give the eager flow's mel, for mixed
streams (different prompts, chunk and cache lengths; rows padded up to a bucket). TF32 is off: fp32 compares fp32.
The micro model with small buckets checks the padding and the static buffers fast; the released size (marked slow)
captures every bucket a server captures (about 260 graphs, 3.7 GiB of static buffers in fp32) and checks the real
shapes. tests/engine/test_dit_graphs.py checks the same buckets emulated on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice2.dit.flow import FlowState
from cosyvoice2.dit.graphs import DiTStepGraphs
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.dit.token2wav import DiTToken2Wav
from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2.testing.dit import write_dit_model, write_full_size_random_dit
from tests.engine.test_dit_graphs import BUCKETS, MIXES, recording, run_flow

REPLAY_ATOL = 1e-4  # fp32 mel; measured at the released size on an H200: under 2e-6


def test_replayed_graphs_equal_eager_on_the_micro_model(gpus, no_tf32, tmp_path) -> None:
    engine = load_dit_token2wav(write_dit_model(tmp_path / "dit", seed=5), device="cuda")
    graphs = DiTStepGraphs(engine.flow.decoder, BUCKETS)
    assert graphs.capture_all(torch.device("cuda"), torch.float32) == len(BUCKETS.shapes())
    for name, mix in MIXES.items():
        shapes = recording(graphs)
        eager, _ = run_flow(engine, mix, None)
        replayed, _ = run_flow(engine, mix, graphs)
        assert shapes, name
        for a_stream, b_stream in zip(eager, replayed):
            for a, b in zip(a_stream, b_stream, strict=True):
                assert a.shape == b.shape and (a - b).abs().max() <= REPLAY_ATOL, name


@torch.inference_mode()
def replay_difference(engine: DiTToken2Wav, graphs: DiTStepGraphs, streams: int, rng: np.random.Generator,
                      max_prompt_tokens: int) -> tuple[float, bool]:
    """(max |mel difference| between the eager flow and the replayed step graphs, whether any call replayed) over
    `streams` streams of different prompts, chunk lengths and cache lengths, 300 tokens each."""
    prompts = [engine.prompt_cache(rng.integers(0, 6561, p), rng.standard_normal((2 * p, 80)).astype(np.float32) - 5,
                                   rng.standard_normal(192).astype(np.float32))
               for p in rng.integers(20, min(200, max_prompt_tokens), streams)]
    plans = [ChunkSchedule(first_hop=int(h), growth=2, max_hop=100).chunks(300) for h in rng.integers(10, 40, streams)]
    tokens = [rng.integers(0, 6561, 300).tolist() for _ in range(streams)]
    worst, used = 0.0, False
    states = {mode: [FlowState.start(p) for p in prompts] for mode in ("eager", "graphs")}
    for index in range(max(map(len, plans))):
        active = [i for i, plan in enumerate(plans) if index < len(plan)]
        chunks = [plans[i][index] for i in active]
        ids = [torch.tensor(tokens[i][c.start:c.feed], device=engine.flow_device)[None] for i, c in zip(active, chunks)]
        mels = {}
        for mode, use in (("eager", None), ("graphs", graphs)):
            results = engine.flow.chunks(ids, [states[mode][i] for i in active], [c.final for c in chunks], use)
            mels[mode] = [mel for _, mel, _ in results]
            for i, (_, _, state) in zip(active, results):
                states[mode][i] = state
        used |= graphs.bucket(len(active), max(m.shape[2] for m in mels["eager"]),
                              max(s.estimator.frames for s in states["eager"]), mels["eager"][0]) is not None
        worst = max([worst] + [float((a - b).abs().max()) for a, b in zip(mels["eager"], mels["graphs"])])
    return worst, used


@pytest.mark.slow
def test_released_size_replays_equal_eager(gpus, no_tf32, tmp_path) -> None:
    engine = load_dit_token2wav(write_full_size_random_dit(tmp_path / "token2wav"), device="cuda", dtype="fp32")
    graphs = engine.graphs
    assert graphs.capture_all(torch.device("cuda"), engine.flow_dtype) > 0
    rng = np.random.default_rng(0)
    max_prompt_tokens = max(graphs.buckets.cache_frames) // engine.token_mel_ratio - 60
    for streams in (1, 3, 5):  # 3 and 5 streams pad to 4 and 8 rows
        worst, used = replay_difference(engine, graphs, streams, rng, max_prompt_tokens)
        assert used, streams
        assert worst <= REPLAY_ATOL, (streams, worst)
