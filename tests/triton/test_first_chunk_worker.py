"""The first-chunk token2wav worker (`--t2w-first-chunk-worker`) on a real tritonserver: concurrent streams get
the audio the default pipeline gives them, their first chunks ran on the first-chunk worker, and every stream
is freed at the end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc.aio as aio

from tests.triton.conftest import FIRST_HOP, SAMPLES_PER_TOKEN, Pipeline, settled_metrics, stream, synthesis_inputs
from triton_repo.render import RenderOptions, write_repository

pytestmark = pytest.mark.triton

TEXTS = ("The first of three streams.", "A second one, somewhat longer than that.", "And a third.")
AUDIO_ATOL = 2e-3  # batching changes float rounding; the tiny random HiFT amplifies it


@pytest.fixture(scope="module")
def worker_pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Pipeline:
    repo = write_repository(
        RenderOptions(
            model_dir=tiny_model_dir,
            out=tmp_path_factory.mktemp("first_chunk_worker") / "repo",
            max_batch=8,
            max_seq_len=2048,
            first_hop=FIRST_HOP,
            t2w_first_chunk_worker=True,
        )
    )
    server = triton_server_factory(repo, ready_timeout=240)
    return Pipeline(server=server, repo=repo, llm_model="engine", token2wav_model="engine")


async def concurrent_streams(pipeline: Pipeline) -> list[np.ndarray]:
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        results = await asyncio.gather(*(stream(client, synthesis_inputs(text, voice=f"voice-{i}", seed=10 + i))
                                         for i, text in enumerate(TEXTS)))
    waves = []
    for chunks in results:
        assert len(chunks) >= 2 and chunks[-1][3]
        wave = np.concatenate([w for w, *_ in chunks])
        assert wave.size == chunks[-1][2] * SAMPLES_PER_TOKEN
        waves.append(wave)
    return waves


async def test_streams_match_the_default_pipeline_and_first_chunks_use_their_worker(worker_pipeline, pipeline):
    got = await concurrent_streams(worker_pipeline)
    want = await concurrent_streams(pipeline)
    for have, expected in zip(got, want, strict=True):
        assert have.size == expected.size
        np.testing.assert_allclose(have, expected, atol=AUDIO_ATOL)
    metrics = await settled_metrics(worker_pipeline)
    assert metrics[("token2wav_first_chunk_calls_total", "engine")] >= 1
    assert metrics[("token2wav_active_streams", "engine")] == 0
    assert metrics[("token2wav_failed_total", "engine")] == 0
    default = await settled_metrics(pipeline)
    assert default.get(("token2wav_first_chunk_calls_total", "engine"), 0) == 0
