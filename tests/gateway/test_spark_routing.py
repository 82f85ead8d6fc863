"""`model="spark-tts"` through the gateway, against stand-ins: a 24 kHz stand-in under CosyVoice2's model names and
a 16 kHz one under Spark-TTS's in one tritonserver. The same text gives the same sine from both, so the resampled
16 kHz audio can be compared with the native 24 kHz audio sample by sample."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
import pytest

import pipeline_contract as contract
from tests.gateway.audio_checks import decode, dominant_frequency
from tests.gateway.standin_model.repository import render_standin_repository
from tests.gateway.standin_model.standin import frequency_for
from tests.gateway.voice_clips import make_clip, upload

pytestmark = pytest.mark.triton

TEXT = "The spark stand-in speaks one long enough sentence for a few chunks."


@pytest.fixture(scope="module")
def both_backend(triton_server_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("spark_standin")
    markers = root / "markers"
    render_standin_repository(root / "models", markers, chunk_count=5, chunk_delay_ms=5)
    render_standin_repository(root / "models", markers, chunk_count=5, chunk_delay_ms=5, sample_rate=16_000,
                              models=(contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL))
    server = triton_server_factory(root / "models")
    yield server
    server.cleanup()  # a module's server goes with it: a whole session's servers at once exhaust a CI machine


@pytest.fixture(scope="module")
def spark_gateway(both_backend, gateway_factory):
    return gateway_factory(both_backend.grpc_url)


def _speech(gateway, model, response_format="pcm", stream=False, voice="alloy"):
    return gateway.client().audio.speech.create(
        model=model, voice=voice, input=TEXT, response_format=response_format, extra_body={"stream": stream}
    ).read()


def test_spark_tts_is_listed_when_deployed(spark_gateway):
    client = spark_gateway.client()
    assert [m.id for m in client.models.list()] == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice2", "spark-tts"]
    assert client.models.retrieve("spark-tts").id == "spark-tts"
    audio_models = client.get("/audio/models", cast_to=object)["models"]
    assert "spark-tts" in [m["id"] for m in audio_models]


def test_spark_tts_is_refused_and_unlisted_where_it_is_not_deployed(gateway):
    client = gateway.client()
    assert "spark-tts" not in [m.id for m in client.models.list()]
    with pytest.raises(Exception) as caught:
        client.audio.speech.create(model="spark-tts", voice="alloy", input="Hello.")
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    assert "not deployed" in caught.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_16k_audio_is_resampled_to_the_24k_pcm_openai_documents(spark_gateway, stream):
    native, rate = decode(_speech(spark_gateway, "tts-1", stream=stream), "pcm")
    spark, _ = decode(_speech(spark_gateway, "spark-tts", stream=stream), "pcm")
    assert rate == 24_000 and spark.size == native.size  # 16 kHz x 1.5, to the sample
    assert abs(dominant_frequency(spark, 24_000) - frequency_for(TEXT)) < 5
    # the same sine: equal away from the filter's first and last few samples (s16 rounding: 1/32768)
    np.testing.assert_allclose(spark[64:-64], native[64:-64], atol=2e-3)


def test_streamed_spark_audio_equals_the_offline_one_across_chunk_boundaries(spark_gateway):
    offline, _ = decode(_speech(spark_gateway, "spark-tts", stream=False), "pcm")
    streamed, _ = decode(_speech(spark_gateway, "spark-tts", stream=True), "pcm")
    assert streamed.size == offline.size
    # one resampler per segment kept across its 5 chunks: no click at any boundary
    np.testing.assert_allclose(streamed, offline, atol=1.5 / 32768)


@pytest.mark.parametrize("response_format", ["wav", "flac", "mp3", "opus", "aac"])
def test_every_format_from_spark_tts_is_at_its_promised_rate(spark_gateway, response_format):
    samples, rate = decode(_speech(spark_gateway, "spark-tts", response_format, stream=True), response_format)
    expected_rate = 48_000 if response_format == "opus" else 24_000
    assert rate == expected_rate and abs(samples.size / rate - 1.36) < 0.1
    if response_format == "wav":
        with wave.open(io.BytesIO(_speech(spark_gateway, "spark-tts", "wav"))) as w:
            assert w.getframerate() == 24_000


def test_the_spark_request_goes_to_the_spark_models_with_the_same_voice(spark_gateway, both_backend):
    _speech(spark_gateway, "spark-tts", voice="nova")
    _speech(spark_gateway, "tts-1", voice="nova")
    # both stand-ins log to one file; the model name says which pipeline each request reached
    log = (both_backend.model_repository.parent / "markers" / "requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in log][-2:]
    assert [r["model"] for r in records] == [contract.SPARK_OFFLINE_MODEL, contract.OFFLINE_MODEL]
    assert records[0]["voice_id"] == records[1]["voice_id"]


def test_a_voice_upload_warms_the_cache_of_each_deployed_model(spark_gateway, both_backend):
    with spark_gateway.http() as http:
        created = upload(http, name="Twice", audio=make_clip("wav", 1.5), transcript="Words to warm.")
    assert created.status_code == 200, created.text
    log = (both_backend.model_repository.parent / "markers" / "requests.jsonl").read_text().splitlines()
    prepared = [r for r in map(json.loads, log) if r["outcome"] == "prepared" and r["voice_id"] == created.json()["id"]]
    assert sorted(r["model"] for r in prepared) == sorted([contract.OFFLINE_MODEL, contract.SPARK_OFFLINE_MODEL])
