"""Spark-TTS beside CosyVoice2 in ONE tritonserver: `render --spark-dir` with a tiny random Spark model next to the
tiny CosyVoice2 model (CPU), the contract's models of both, the server-side stream windows, the masked audio
tokenizer in a shared dynamic batch."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

import pipeline_contract as contract
from speech_serving.spark import SparkVoiceTokenizer
from spark_tts.testing import write_tiny_model
from tests.gateway.audio_checks import FORMAT_RATES, check_speech, decode
from tests.gateway.voice_clips import make_clip, upload
from tests.triton.conftest import FIRST_HOP, offline_chunk, streamed_chunks, synthesis_inputs
from triton_repo import spark_io
from triton_repo.render import RenderError, RenderOptions, write_repository
from triton_repo.spark_render import AUDIO_TOKENIZER, SparkRenderOptions

pytestmark = pytest.mark.triton

TEXT = "Hello world, the tiny Spark model speaks."
HOP = 320  # BiCodec: samples per semantic token at 16 kHz
#: small pieces so that a short utterance streams several (the tiny decoder's receptive radius is 39 tokens)
SPARK = dict(max_new_tokens=160, first_chunk_tokens=10, chunk_scale=1.5, max_seq_len=1024)


@pytest.fixture(scope="session")
def spark_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("spark_model"), seed=2)


@pytest.fixture(scope="module")
def both_server(tiny_model_dir, spark_dir, tmp_path_factory, triton_server_factory):
    """CosyVoice2 and Spark-TTS in one tritonserver; the audio tokenizer waits 300 ms to gather a batch."""
    repo = write_repository(RenderOptions(
        model_dir=tiny_model_dir, out=tmp_path_factory.mktemp("both") / "repo", max_batch=8, max_seq_len=2048,
        first_hop=FIRST_HOP, max_queue_delay_us=300_000, spark=SparkRenderOptions(spark_dir, **SPARK),
    ))  # fmt: skip
    server = triton_server_factory(repo, ready_timeout=240)
    yield server
    server.cleanup()


async def _offline(url, model, inputs):
    chunk = await offline_chunk(url, model, inputs)
    return chunk.waveform, chunk.output_tokens, chunk.sample_rate


async def _stream(client, inputs):
    chunks = await streamed_chunks(client, contract.SPARK_STREAMING_MODEL, inputs)
    return [(c.waveform, c.output_tokens, c.sample_rate, c.final) for c in chunks]


async def test_spark_offline_is_16k_with_320_samples_per_token(both_server):
    waveform, tokens, rate = await _offline(both_server.grpc_url, contract.SPARK_OFFLINE_MODEL,
                                            synthesis_inputs(TEXT, seed=3))
    assert rate == 16_000 and tokens > 0 and waveform.size == tokens * HOP
    assert np.isfinite(waveform).all() and 0 < np.abs(waveform).max() <= 1
    again, *_ = await _offline(both_server.grpc_url, contract.SPARK_OFFLINE_MODEL, synthesis_inputs(TEXT, seed=3))
    np.testing.assert_array_equal(again, waveform)  # the seed reproduces a request (its voice now cached)


async def test_cosyvoice2_beside_it_states_24k(both_server):
    waveform, tokens, rate = await _offline(both_server.grpc_url, contract.OFFLINE_MODEL, synthesis_inputs(TEXT))
    assert rate == contract.OUTPUT_SAMPLE_RATE == 24_000 and tokens > 0 and waveform.size > 0


async def test_spark_streams_one_continuous_waveform_equal_to_the_offline_one(both_server):
    url = both_server.grpc_url
    texts = [TEXT, "Another voice streams beside it."]
    offline = [await _offline(url, contract.SPARK_OFFLINE_MODEL, synthesis_inputs(t, seed=s, voice=v))
               for t, s, v in ((texts[0], 4, "voice-a"), (texts[1], 5, "voice-bb"))]
    async with aio.InferenceServerClient(url) as client:
        streams = await asyncio.gather(_stream(client, synthesis_inputs(texts[0], seed=4, voice="voice-a")),
                                       _stream(client, synthesis_inputs(texts[1], seed=5, voice="voice-bb")))
    for (wave, tokens, _), chunks in zip(offline, streams):
        assert len(chunks) >= 3 and [c[3] for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert {c[2] for c in chunks} == {16_000} and chunks[-1][1] == tokens
        counts = [c[1] for c in chunks]
        assert counts == sorted(counts) and counts[0] < counts[-1]  # audio left before the LLM had finished
        streamed = np.concatenate([c[0] for c in chunks])
        assert streamed.size == wave.size
        np.testing.assert_allclose(streamed, wave, atol=1e-4)  # no seams: the overlap is resolved on the server


async def test_voices_by_id_are_per_model(both_server):
    """A voice CosyVoice2 holds is unknown to Spark-TTS by id (its prompt is not Spark's tokens); once sent to Spark
    with its audio, both Spark models serve it by id alone."""
    url, voice = both_server.grpc_url, "voice-per-model"
    await _offline(url, contract.OFFLINE_MODEL, synthesis_inputs("", voice=voice))  # CosyVoice2 holds it
    with pytest.raises(InferenceServerException, match=r"\[unknown_voice\]"):
        await _offline(url, contract.SPARK_OFFLINE_MODEL, synthesis_inputs(TEXT, voice=voice, by_id=True))
    await _offline(url, contract.SPARK_OFFLINE_MODEL, synthesis_inputs("", voice=voice))  # the audio once
    waveform, tokens, _ = await _offline(url, contract.SPARK_OFFLINE_MODEL,
                                         synthesis_inputs(TEXT, voice=voice, seed=5, by_id=True))
    assert tokens > 0 and waveform.size == tokens * HOP
    async with aio.InferenceServerClient(url) as client:
        streamed = await _stream(client, synthesis_inputs(TEXT, voice=voice, seed=5, by_id=True))
    # the same voice tokens, hence the same speech: equal up to the windows' float rounding (as streaming is)
    np.testing.assert_allclose(np.concatenate([w for w, *_ in streamed]), waveform, atol=1e-4)


async def test_spark_refuses_instructions_and_keeps_the_warm_up_rule(both_server):
    with pytest.raises(Exception, match=r"\[invalid_input\].*instruct"):
        await _offline(both_server.grpc_url, contract.SPARK_OFFLINE_MODEL,
                       synthesis_inputs(TEXT, instruction="Speak sadly"))
    waveform, tokens, rate = await _offline(both_server.grpc_url, contract.SPARK_OFFLINE_MODEL,
                                            synthesis_inputs("", voice="warm-spark"))
    assert waveform.size == 0 and tokens == 0 and rate == 16_000


@pytest.mark.parametrize("inputs, message", [
    (lambda: synthesis_inputs(TEXT, seconds=0.05), "reference_wav_len"),
    (lambda: synthesis_inputs("word " * (contract.MAX_SEGMENT_TOKENS + 1)), "at most 300"),
], ids=["short-reference", "long-segment"])
async def test_spark_refuses_what_the_contract_refuses(both_server, inputs, message):
    for model in (contract.SPARK_OFFLINE_MODEL, contract.OFFLINE_MODEL):  # the same rules as CosyVoice2's
        with pytest.raises(Exception, match=rf"\[invalid_input\].*{message}"):
            await _offline(both_server.grpc_url, model, inputs())


def _tokenize_inputs(wav):
    inputs = []
    wav_len = np.array([[wav.size]], np.int32)
    for spec, value in ((contract.REFERENCE_WAV, wav[None]), (contract.REFERENCE_WAV_LEN, wav_len)):
        tensor = grpcclient.InferInput(spec.name, list(value.shape), spec.triton_dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


async def test_a_short_reference_keeps_its_tokens_in_a_shared_batch(both_server, spark_dir):
    rng = np.random.default_rng(7)
    short, long = (rng.standard_normal(n).astype(np.float32) * 0.1 for n in (8_000, 24_000))
    names = [spark_io.GLOBAL_TOKENS.name, spark_io.SEMANTIC_TOKENS.name]

    async def tokens(client, wav):
        result = await client.infer(AUDIO_TOKENIZER, _tokenize_inputs(wav),
                                    outputs=[grpcclient.InferRequestedOutput(n) for n in names])
        return [result.as_numpy(n).reshape(-1) for n in names]

    async def batched_requests(client):  # inferences that shared an execution with another one
        stats = (await client.get_inference_statistics(AUDIO_TOKENIZER)).model_stats[0]
        return stats.inference_count - stats.execution_count

    async with aio.InferenceServerClient(both_server.grpc_url) as client:
        solo = await tokens(client, short)
        before = await batched_requests(client)
        # sent together, they reach the model as one dynamic batch (300 ms queue delay) of two lengths
        shared, _ = await asyncio.gather(tokens(client, short), tokens(client, long))
        assert await batched_requests(client) == before + 1
    [expected] = SparkVoiceTokenizer(spark_dir).tokenize([short])  # the engine's tokens of it alone
    assert solo[0].size == 32 and solo[1].size == 24  # 0.5 s: 24 frames of wav2vec2's conv front end
    np.testing.assert_array_equal(solo[0], expected.global_tokens)
    np.testing.assert_array_equal(solo[1], expected.semantic_tokens)
    for alone, batched in zip(solo, shared):
        np.testing.assert_array_equal(batched, alone)


def test_render_without_spark_dir_renders_no_spark_model(tiny_model_dir, tmp_path):
    repo = write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo"))
    assert not any(p.name.startswith("spark") for p in repo.iterdir())


def test_render_refuses_an_incomplete_spark_dir(tiny_model_dir, spark_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(RenderError, match="--spark-dir"):
        write_repository(RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo",
                                       spark=SparkRenderOptions(broken)))
    assert not (tmp_path / "repo").exists()


# -- through the gateway, with the OpenAI SDK ------------------------------------------------------------------
@pytest.fixture(scope="module")
def spark_gateway(both_gateway):
    return both_gateway


def test_the_gateway_lists_spark_tts_beside_cosyvoice2(spark_gateway):
    models = [m.id for m in spark_gateway.client().models.list()]
    assert models[-1] == "spark-tts" and "tts-1" in models


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streaming"])
@pytest.mark.parametrize("response_format", sorted(FORMAT_RATES))
def test_the_gateway_serves_spark_tts_in_every_format(spark_gateway, response_format, stream):
    data = spark_gateway.client().audio.speech.create(
        model="spark-tts", voice="alloy", input="Hello from Spark.", response_format=response_format,
        extra_body={"stream": stream, "seed": 11},
    ).read()
    check_speech(data, response_format, whole=HOP * 3 // 2)  # tokens of 320 samples at 16 kHz, x1.5 at 24 kHz


def test_streamed_and_offline_spark_pcm_match_through_the_gateway(spark_gateway):
    def pcm(stream):
        return decode(spark_gateway.client().audio.speech.create(
            model="spark-tts", voice="nova", input=TEXT, response_format="pcm",
            extra_body={"stream": stream, "seed": 4},
        ).read(), "pcm")[0]

    offline, streamed = pcm(False), pcm(True)
    assert offline.size == streamed.size > 0
    np.testing.assert_allclose(streamed, offline, atol=3 / 32768)  # s16 rounding of float differences < 1e-4


def test_an_uploaded_voice_speaks_with_both_models(spark_gateway):
    with spark_gateway.http() as http:
        created = upload(http, name="Sparky", audio=make_clip("wav", 1.5), transcript="Words of the clip.")
    assert created.status_code == 200, created.text
    for model in ("tts-1", "spark-tts"):
        data = spark_gateway.client().audio.speech.create(model=model, voice="Sparky", input="Hi there.",
                                                          response_format="wav").read()
        samples, rate = decode(data, "wav")
        assert rate == 24_000 and samples.size > 0
