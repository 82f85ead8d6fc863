"""The DiT token2wav behind the real pipeline: `render --token2wav dit` with a micro random DiT directory (the tiny
CosyVoice2 model still provides the LLM and the voice frontend), tritonserver on CPU, and the gateway on top."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc.aio as aio

from cosyvoice2.testing.dit import write_dit_model
from tests.gateway.audio_checks import decode
from tests.triton.conftest import FIRST_HOP, Pipeline, SAMPLES_PER_TOKEN, stream, synthesis_inputs, wait_metrics
import pipeline_contract as contract
from triton_repo.render import RenderError, RenderOptions, write_repository

pytestmark = pytest.mark.triton

TEXT = "Hello world, the tiny model speaks through the DiT flow."


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory):
    return write_dit_model(tmp_path_factory.mktemp("dit_model"), seed=4)


@pytest.fixture(scope="module")
def dit_server(tiny_model_dir, dit_dir, tmp_path_factory, triton_server_factory):
    repo = write_repository(RenderOptions(
        model_dir=tiny_model_dir, out=tmp_path_factory.mktemp("dit_pipeline") / "repo", max_batch=8,
        max_seq_len=2048, first_hop=FIRST_HOP, token2wav="dit", dit_dir=dit_dir,
    ))
    server = triton_server_factory(repo, ready_timeout=240)
    yield Pipeline(server=server, repo=repo, llm_model=contract.STREAMING_MODEL,
                   token2wav_model=contract.STREAMING_MODEL)
    server.cleanup()


def test_the_dit_samples_per_token_are_the_pipelines(dit_dir):
    from cosyvoice2.dit.loading import load_dit_token2wav

    # the DiT stream emits 960 samples per token in all, the same count the UNet token2wav gives (conftest)
    assert load_dit_token2wav(dit_dir).samples_per_token == SAMPLES_PER_TOKEN


async def offline(url: str, seed: int):
    async with aio.InferenceServerClient(url) as client:
        result = await client.infer(contract.OFFLINE_MODEL, synthesis_inputs(TEXT, seed=seed))
    return result.as_numpy(contract.WAVEFORM.name), int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0])


async def test_offline_dit_audio_has_960_samples_per_token_and_is_not_the_unet_audio(dit_server, pipeline):
    waveform, tokens = await offline(dit_server.server.grpc_url, seed=5)
    assert tokens > 0 and waveform.dtype == np.float32 and waveform.size == tokens * SAMPLES_PER_TOKEN
    assert np.isfinite(waveform).all() and np.abs(waveform).max() > 0
    again, _ = await offline(dit_server.server.grpc_url, seed=5)  # the voice's prompt cache is reused: same audio
    np.testing.assert_array_equal(again, waveform)
    unet, unet_tokens = await offline(pipeline.server.grpc_url, seed=5)  # same LLM, same seed: same tokens
    assert unet_tokens == tokens and unet.size == waveform.size and not np.allclose(unet, waveform, atol=1e-3)


async def test_streaming_dit_chunks_add_up_to_960_samples_per_token(dit_server):
    texts = [TEXT, "A second stream with another voice runs next to it."]
    async with aio.InferenceServerClient(dit_server.server.grpc_url) as client:
        results = await asyncio.gather(
            stream(client, synthesis_inputs(texts[0], seed=6)),
            stream(client, synthesis_inputs(texts[1], seed=7, voice="voice-bb")),
        )
    for chunks in results:
        assert len(chunks) >= 3 and [f for *_, f in chunks] == [False] * (len(chunks) - 1) + [True]
        counts = [tokens for _, _, tokens, _ in chunks]
        assert counts == sorted(counts) and counts[0] < counts[-1]  # audio left before the LLM had finished
        audio = np.concatenate([w for w, *_ in chunks])
        assert audio.size == counts[-1] * SAMPLES_PER_TOKEN and np.isfinite(audio).all()
    metrics = await wait_metrics(dit_server, lambda m: m[("token2wav_active_streams", contract.STREAMING_MODEL)] == 0)
    assert metrics[("token2wav_active_streams", contract.STREAMING_MODEL)] == 0


@pytest.mark.parametrize("response_format", ["wav", "flac", "mp3"])
def test_the_gateway_speaks_through_the_dit_pipeline(dit_server, gateway_factory, response_format):
    gateway = gateway_factory(dit_server.server.grpc_url)
    data = gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the DiT pipeline.", response_format=response_format
    ).read()
    samples, rate = decode(data, response_format)
    assert rate == 24_000 and samples.size > 0 and np.abs(samples).max() > 0
    if response_format != "mp3":  # lossless: whole speech tokens
        assert samples.size % SAMPLES_PER_TOKEN == 0


def test_render_refuses_a_dit_directory_without_the_flow(tiny_model_dir, dit_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("flow.yaml", "hift.pt"):
        (broken / name).write_bytes((dit_dir / name).read_bytes())
    with pytest.raises(RenderError, match="lacks flow.pt"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", token2wav="dit",
                                       dit_dir=broken))
    assert not (tmp_path / "repo").exists()
