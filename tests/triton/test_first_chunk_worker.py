"""The first-chunk token2wav worker (`--t2w-first-chunk-worker`) and first chunks between the Euler steps of
running calls (`--t2w-first-chunks-between-steps`) on a real tritonserver: concurrent streams get the audio the
default pipeline gives them (with the worker, their first chunks ran on it), and every stream is freed at the
end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc.aio as aio

from tests.triton.conftest import (
    SAMPLES_PER_TOKEN, Pipeline, colocated_pipeline, settled_metrics, stream, synthesis_inputs,
)

pytestmark = pytest.mark.triton

TEXTS = ("The first of three streams.", "A second one, somewhat longer than that.", "And a third.")
AUDIO_ATOL = 2e-3  # batching changes float rounding; the tiny random HiFT amplifies it


@pytest.fixture(scope="module", params=["t2w_first_chunk_worker", "t2w_first_chunks_between_steps"])
def worker_pipeline(request, tiny_model_dir, tmp_path_factory, triton_server_factory) -> Pipeline:
    out = tmp_path_factory.mktemp("first_chunk_worker") / "repo"
    return colocated_pipeline(tiny_model_dir, out, triton_server_factory, **{request.param: True})


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
    if _worker(worker_pipeline):
        assert metrics[("token2wav_first_chunk_calls_total", "engine")] >= 1
    else:
        assert metrics.get(("token2wav_first_chunk_calls_total", "engine"), 0) == 0
    assert metrics[("token2wav_active_streams", "engine")] == 0
    assert metrics[("token2wav_failed_total", "engine")] == 0
    default = await settled_metrics(pipeline)
    assert default.get(("token2wav_first_chunk_calls_total", "engine"), 0) == 0


def _worker(pipeline: Pipeline) -> bool:
    """Whether the pipeline was rendered with the first-chunk worker (from its rendered parameters)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    text_format.Parse((pipeline.repo / "engine" / "config.pbtxt").read_text(), config)
    return config.parameters["t2w_first_chunk_worker"].string_value == "true"
