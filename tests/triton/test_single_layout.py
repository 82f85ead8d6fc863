"""`--layout single`: the separate `llm` and `token2wav` models still serve (one offline, one streaming request)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tritonclient.grpc.aio as aio

from tests.triton.conftest import FIRST_HOP, SAMPLES_PER_TOKEN, Pipeline, settled_metrics, stream, synthesis_inputs
import pipeline_contract as contract
from triton_repo.render import RenderOptions, write_repository

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def single_pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Iterator[Pipeline]:
    repo = write_repository(
        RenderOptions(
            model_dir=tiny_model_dir,
            out=tmp_path_factory.mktemp("single") / "repo",
            layout="single",
            max_batch=2,
            max_seq_len=1024,
            first_hop=FIRST_HOP,
        )
    )
    server = triton_server_factory(repo, ready_timeout=240)
    yield Pipeline(server=server, repo=repo, llm_model="llm", token2wav_model="token2wav")
    server.cleanup()


async def test_offline_and_streaming_requests_run_through_llm_and_token2wav(single_pipeline):
    assert {p.name for p in single_pipeline.repo.iterdir()} >= {"llm", "token2wav"}
    async with aio.InferenceServerClient(single_pipeline.server.grpc_url) as client:
        result = await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("One offline request.", seed=3))
        chunks = await stream(client, synthesis_inputs("One streaming request, a little longer.", seed=4))
    tokens = int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
    assert tokens > 0 and result.as_numpy(contract.WAVEFORM.name).size == tokens * SAMPLES_PER_TOKEN
    assert len(chunks) >= 2 and chunks[-1][3]
    assert sum(w.size for w, *_ in chunks) == chunks[-1][2] * SAMPLES_PER_TOKEN
    metrics = await settled_metrics(single_pipeline)
    assert metrics[("llm_finished_total", "llm")] == 2  # both sequences ran in the separate llm model
    assert metrics[("token2wav_chunks_total", "token2wav")] == 1 + len(chunks)
    assert metrics[("llm_active_sequences", "llm")] == metrics[("token2wav_active_streams", "token2wav")] == 0
    # the streaming request's first chunk, counted once in each layer's own model
    counts = [metrics[("orchestrator_first_chunks_total", contract.STREAMING_MODEL)],
              metrics[("llm_first_chunks_total", "llm")], metrics[("token2wav_first_chunks_total", "token2wav")]]
    assert counts == [1, 1, 1]
    assert metrics[("token2wav_first_chunk_call_seconds_total", "token2wav")] > 0
    # only the separate models run an LLM or token2wav (the entry models orchestrate over BLS)
    assert not any(name.startswith(("llm_", "token2wav_")) and model not in ("llm", "token2wav")
                   for name, model in metrics)
