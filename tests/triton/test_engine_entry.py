"""The colocated layout: the streaming entry model is the engine's process, its orchestrator calling the LLM's
scheduler and token2wav's service directly; the offline entry model reaches that engine over BLS. A real
tritonserver with the tiny random model (the session's default pipeline), against the single layout, whose entry
models orchestrate over BLS."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from tests.gateway.audio_checks import decode
from tests.triton.conftest import (
    SAMPLES_PER_TOKEN,
    Pipeline,
    colocated_pipeline,
    settled_metrics,
    stream,
    synthesis_inputs,
    wait_metrics,
)
import pipeline_contract as contract
from triton_repo.render import RenderOptions
from triton_repo.render_checks import check_options
from triton_repo.render_options import RenderError

pytestmark = pytest.mark.triton

STREAM = contract.STREAMING_MODEL
#: What a request holds in the engine's process until it ends, by its gauge.
RELEASED = ("orchestrator_active_requests", "llm_active_sequences", "token2wav_active_streams")


@pytest.fixture(scope="module")
def bls_pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Iterator[Pipeline]:
    """The single layout with the default pipeline's settings: the same engines, orchestrated over BLS."""
    pipeline = colocated_pipeline(tiny_model_dir, tmp_path_factory.mktemp("bls") / "repo", triton_server_factory,
                                  layout="single")
    yield Pipeline(server=pipeline.server, repo=pipeline.repo, llm_model="llm", token2wav_model="token2wav")
    pipeline.server.cleanup()


def test_the_engine_entry_model_runs_as_one_instance(tiny_model_dir, tmp_path):
    with pytest.raises(RenderError, match=f"{STREAM} holds the engine .*one instance"):
        check_options(RenderOptions(model_dir=tiny_model_dir, out=tmp_path, instances={STREAM: 2}))
    check_options(RenderOptions(model_dir=tiny_model_dir, out=tmp_path, layout="single", instances={STREAM: 2}))


async def test_streams_are_the_bls_pipelines_streams(pipeline, bls_pipeline):
    """The same request, seeded, makes the same chunks whether the orchestrator calls the LLM and token2wav over
    BLS or in their own process."""
    inputs = dict(text="The same words through both orchestrations.", seed=11)
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        here = await stream(client, synthesis_inputs(**inputs))
    async with aio.InferenceServerClient(bls_pipeline.server.grpc_url) as client:
        there = await stream(client, synthesis_inputs(**inputs))
    assert len(here) >= 3 and [c[1:] for c in here] == [c[1:] for c in there]  # tokens and flags, chunk by chunk
    for (mine, *_), (theirs, *_) in zip(here, there):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert sum(w.size for w, *_ in here) == here[-1][2] * SAMPLES_PER_TOKEN


async def test_offline_requests_reach_the_engine_over_bls(pipeline):
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        before = await settled_metrics(pipeline)
        result = await client.infer(contract.OFFLINE_MODEL, synthesis_inputs("An offline request.", seed=5))
    tokens = int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
    assert tokens > 0 and result.as_numpy(contract.WAVEFORM.name).size == tokens * SAMPLES_PER_TOKEN
    after = await settled_metrics(pipeline)
    # the LLM and token2wav that answered are the streaming model's; the offline model orchestrated
    assert after[("llm_finished_total", STREAM)] == before.get(("llm_finished_total", STREAM), 0) + 1
    key = ("orchestrator_requests_total", contract.OFFLINE_MODEL)
    assert after[key] == before.get(key, 0) + 1


async def test_concurrent_streams_and_a_cancelled_one_leave_nothing_behind(pipeline):
    texts = [f"Stream number {i} speaks beside the others." for i in range(6)]
    long_text = " ".join(["This sentence keeps the language model busy for a long while."] * 4)
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        before = await settled_metrics(pipeline)
        *results, cut = await asyncio.gather(*(stream(client, synthesis_inputs(t, seed=i)) for i, t in enumerate(texts)),
                                             stream(client, synthesis_inputs(long_text, seed=9), cancel_after=1))
    for chunks in results:
        assert chunks[-1][3] and sum(w.size for w, *_ in chunks) == chunks[-1][2] * SAMPLES_PER_TOKEN
    assert len(cut) == 1 and not cut[0][3]

    def released(m):
        return all(m[(name, STREAM)] == 0 for name in RELEASED)

    metrics = await wait_metrics(pipeline, released)
    assert released(metrics), {name: metrics[(name, STREAM)] for name in RELEASED}
    # every LLM sequence ended exactly once: the cut stream's cancelled, or finished when its few hundred tokens were
    # decoded before the cancel arrived (the tiny model on a busy CPU; test_pipeline counts a cancel alone)
    ends = ("llm_finished_total", "llm_cancelled_total", "llm_failed_total")
    ended = sum(metrics.get((name, STREAM), 0) - before.get((name, STREAM), 0) for name in ends)
    assert ended == len(texts) + 1, {name: metrics.get((name, STREAM), 0) for name in ends}


async def test_bad_requests_are_refused_in_the_contracts_words_before_any_audio(pipeline):
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        with pytest.raises(InferenceServerException, match="reference_wav_len"):
            await stream(client, synthesis_inputs("Too short a reference.", seconds=0.05))
        no_text = [i for i in synthesis_inputs("Missing its text.") if i.name() != contract.TARGET_TEXT.name]
        with pytest.raises(InferenceServerException, match="target_text"):
            await stream(client, no_text)
        with pytest.raises(InferenceServerException, match=contract.ERROR_UNKNOWN_VOICE.strip("[]")):
            await stream(client, synthesis_inputs("A voice never sent.", voice="never-sent", by_id=True))
        chunks = await stream(client, synthesis_inputs("Still serving.", seed=2))  # and the model serves on
    assert chunks[-1][3]


async def test_the_openai_sdk_streams_through_the_gateway_and_the_engine_entry(pipeline, gateway_factory):
    """The gateway's SSE stream (the OpenAI SDK) over a pipeline whose streaming model is the engine: several audio
    deltas, whole speech tokens, the usage the pipeline counted; the second request finds its voice in the engine
    process's prompt cache."""
    gateway = gateway_factory(pipeline.server.grpc_url)
    before = await settled_metrics(pipeline)
    for attempt in range(2):
        with gateway.client().audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=f"Through the gateway, request {attempt}.", response_format="pcm",
            stream_format="sse",
        ) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        done = events[-1]
        assert done["type"] == "speech.audio.done" and len(events) >= 3
        samples, _ = decode(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), "pcm")
        assert samples.size == done["usage"]["output_tokens"] * SAMPLES_PER_TOKEN > 0
    after = await settled_metrics(pipeline)
    hits = ("voice_cache_hits_total", STREAM)
    assert after.get(hits, 0) >= before.get(hits, 0) + 1
