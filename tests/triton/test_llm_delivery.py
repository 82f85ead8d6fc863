"""Tokens at chunk granularity: the PyTorch LLM answers a streaming request with a delivery schedule
(`deliver_at`) once per boundary reached and at the end, with the same tokens and the same audio as
per-token delivery (tiny random model, CPU, the default colocated layout)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio

from cosyvoice2.config import EngineConfig
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.io_struct import LLMRequest
from tests.triton.conftest import Pipeline, colocated_pipeline, settled_metrics, stream, synthesis_inputs
from triton_repo import internal_io as io

pytestmark = pytest.mark.triton

MAX_TOKENS = 70
DELIVER_AT = (8, 18, 38, 68)  # first hop 5 + lookahead 3, then hops 10, 20, 30 (any ascending counts work)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir) -> SpeechVocabLayout:
    config = EngineConfig.for_model_dir(tiny_model_dir)
    return SpeechVocabLayout(len(CosyVoice2Tokenizer.from_model_dir(tiny_model_dir)), config.llm.speech_token_size)


def llm_request(tiny_model_dir, vocab: SpeechVocabLayout, deliver_at: tuple[int, ...] | None) -> LLMRequest:
    text = CosyVoice2Tokenizer.from_model_dir(tiny_model_dir).encode("the tiny model speaks")
    input_ids = np.array([vocab.sos_id, *text, vocab.task_id_id, *vocab.to_vocab_ids(np.arange(12))], np.int32)
    # min_tokens = max: the random model cannot stop early, so every boundary is reached
    return LLMRequest(input_ids, MAX_TOKENS, MAX_TOKENS, seed=11, top_k=25, top_p=0.8, temperature=1.0,
                      streaming=True, deliver_at=deliver_at)  # fmt: skip


async def engine_responses(pipeline: Pipeline, request: LLMRequest, vocab, request_id: str) -> list[list[int]]:
    """The token ids of every data response of one streaming LLM request sent straight to the engine."""
    specs = {spec.name: spec for spec in io.ENGINE_INPUTS}
    inputs = []
    for name, value in io.llm_request_tensors(request, vocab, None, deliver_at=True).items():
        tensor = grpcclient.InferInput(name, list(value.shape), specs[name].triton_dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)

    async def requests():
        yield {"model_name": pipeline.llm_model, "inputs": inputs, "request_id": request_id}

    out = []
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise error
            out.append(io.llm_response_ids({name: result.as_numpy(name) for name in ("output_ids", "sequence_length")}))
    return out


async def test_a_delivery_schedule_gets_one_response_per_boundary_and_the_same_tokens(pipeline, tiny_model_dir, vocab):
    scheduled = await engine_responses(pipeline, llm_request(tiny_model_dir, vocab, DELIVER_AT), vocab, "41")
    per_token = await engine_responses(pipeline, llm_request(tiny_model_dir, vocab, None), vocab, "42")
    tokens = [t for response in scheduled for t in response]
    assert tokens == [t for response in per_token for t in response] and len(tokens) == MAX_TOKENS
    # cumulative counts at the responses: exactly the boundaries reached (68 < 70) and the end
    assert np.cumsum([len(r) for r in scheduled]).tolist() == [8, 18, 38, 68, 70]
    assert len(per_token) > len(scheduled)  # without a schedule: a response per decoded token (merged when late)


@pytest.fixture(scope="module")
def per_token_pipeline(tiny_model_dir, tmp_path_factory, triton_server_factory) -> Iterator[Pipeline]:
    """The default pipeline's options, rendered to deliver LLM tokens one response per token."""
    out = tmp_path_factory.mktemp("per_token") / "repo"
    pipeline = colocated_pipeline(tiny_model_dir, out, triton_server_factory, llm_delivery="token")
    yield pipeline
    pipeline.server.cleanup()


async def streamed(pipeline: Pipeline, text: str, seed: int):
    """(chunks, LLM responses the request caused) of one streaming request."""
    key = ("llm_responses_total", pipeline.llm_model)
    before = await settled_metrics(pipeline)
    async with aio.InferenceServerClient(pipeline.server.grpc_url) as client:
        chunks = await stream(client, synthesis_inputs(text, seed=seed))
    after = await settled_metrics(pipeline)
    return chunks, after[key] - before.get(key, 0)


async def test_chunk_delivery_streams_the_same_audio_as_per_token_delivery_with_a_response_per_chunk(
    pipeline, per_token_pipeline
):
    text = "Chunk boundaries decide when the orchestrator hears from the language model."
    chunked, chunked_responses = await streamed(pipeline, text, seed=21)
    per_token, _ = await streamed(per_token_pipeline, text, seed=21)
    # (a chunk's cumulative `output_tokens` says how many tokens existed when it ran: with per-token delivery
    # that may exceed its boundary, so only the totals are compared)
    assert [(c[1], c[3]) for c in chunked] == [(c[1], c[3]) for c in per_token] and chunked[-1][2] == per_token[-1][2]
    for (audio, *_), (expected, *_) in zip(chunked, per_token, strict=True):
        np.testing.assert_array_equal(audio, expected)
    tokens = chunked[-1][2]
    assert len(chunked) >= 3 and tokens > 2 * len(chunked)
    # one LLM hand-over per non-final chunk + the end (+ a flag-only final when a stop id came right after a
    # boundary). Per token there is no fixed count to compare: in the engine's process the orchestrator takes,
    # between its token2wav calls, every token that came meanwhile as one hand-over (the test above counts
    # per-token responses of the engine's own requests)
    assert len(chunked) <= chunked_responses <= len(chunked) + 1
