"""`model="cosyvoice3"` through the gateway, against stand-ins: CosyVoice2's, Spark-TTS's (16 kHz) and CosyVoice3's
model names in one tritonserver. What each pipeline receives (the stand-ins' request log) shows the routing, the
instruct mode per model and the voices remembered per pipeline."""

from __future__ import annotations

import json

import openai
import pytest

import pipeline_contract as contract
from tests.gateway.standin_model.repository import render_standin_repository
from tests.gateway.voice_clips import make_clip, upload

pytestmark = pytest.mark.triton

ALL_MODELS = ["tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice2", "spark-tts", "cosyvoice3"]


@pytest.fixture(scope="module")
def three_backend(triton_server_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("cosyvoice3_standin")
    markers = root / "markers"
    for models, rate in (((contract.OFFLINE_MODEL, contract.STREAMING_MODEL), 24_000),
                         ((contract.SPARK_OFFLINE_MODEL, contract.SPARK_STREAMING_MODEL), 16_000),
                         ((contract.COSYVOICE3_OFFLINE_MODEL, contract.COSYVOICE3_STREAMING_MODEL), 24_000)):
        render_standin_repository(root / "models", markers, chunk_count=3, chunk_delay_ms=5, models=models,
                                  sample_rate=rate)
    server = triton_server_factory(root / "models")
    yield server
    server.cleanup()  # a module's server goes with it


@pytest.fixture(scope="module")
def three_gateway(three_backend, gateway_factory):
    return gateway_factory(three_backend.grpc_url)


def _log(backend) -> list[dict]:
    lines = (backend.model_repository.parent / "markers" / "requests.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _speech(gateway, model, text, **extra):
    return gateway.client().audio.speech.create(model=model, voice="alloy", input=text, response_format="wav",
                                                extra_body={"stream": False, **extra}).read()


def test_cosyvoice3_is_listed_when_deployed(three_gateway):
    client = three_gateway.client()
    assert [m.id for m in client.models.list()] == ALL_MODELS
    assert client.models.retrieve("cosyvoice3").id == "cosyvoice3"
    assert "cosyvoice3" in [m["id"] for m in client.get("/audio/models", cast_to=object)["models"]]


def test_cosyvoice3_is_refused_and_unlisted_where_it_is_not_deployed(gateway):
    client = gateway.client()
    assert "cosyvoice3" not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.speech.create(model="cosyvoice3", voice="alloy", input="Hello.")
    assert caught.value.code == "model_not_found" and "not deployed" in caught.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streaming"])
def test_cosyvoice3_requests_reach_its_models_with_their_instructions(three_gateway, three_backend, stream):
    tag = f"zqcvthree{'ab'[stream]}"
    _speech(three_gateway, "cosyvoice3", f"{tag} speaks now.", stream=stream, instructions="  Whisper it.  ")
    [record] = [r for r in _log(three_backend) if r["tag"] == tag]
    expected = contract.COSYVOICE3_STREAMING_MODEL if stream else contract.COSYVOICE3_OFFLINE_MODEL
    assert record["model"] == expected and record["instruction_text"] == "Whisper it."


def test_instructions_for_a_model_without_an_instruct_mode_are_refused_before_synthesis(three_gateway, three_backend):
    before = len(_log(three_backend))
    for stream_format in ("audio", "sse"):
        with pytest.raises(openai.BadRequestError) as caught:
            three_gateway.client().audio.speech.create(
                model="spark-tts", voice="alloy", input="zqnoinstruct here.", instructions="Speak sadly.",
                extra_body={"stream_format": stream_format})
        assert caught.value.code == "unsupported_value" and caught.value.param == "instructions"
        assert "no instruct mode" in caught.value.message
    assert len(_log(three_backend)) == before  # refused by the gateway: no pipeline saw it
    _speech(three_gateway, "spark-tts", "zqnoinstruct blank.", instructions="   ")  # blank: no instruction at all


def test_each_pipeline_is_sent_a_voice_with_its_audio_once(three_gateway, three_backend):
    """The voice cache is per model: CosyVoice3's first request with a voice carries its audio even when
    CosyVoice2 already holds it; its second names the voice by id alone."""
    for model, tag in (("tts-1", "zqvoicea"), ("cosyvoice3", "zqvoiceb"), ("cosyvoice3", "zqvoicec"),
                       ("tts-1", "zqvoiced")):
        three_gateway.client().audio.speech.create(model=model, voice="ballad", input=f"{tag} is here.",
                                                   response_format="wav", extra_body={"stream": False}).read()
    records = {r["tag"]: r for r in _log(three_backend) if r["tag"].startswith("zqvoice")}
    assert [records[t]["carries_audio"] for t in ("zqvoicea", "zqvoiceb", "zqvoicec", "zqvoiced")] == [
        True, True, False, False]
    assert records["zqvoiceb"]["model"] == contract.COSYVOICE3_OFFLINE_MODEL
    assert len({r["voice_id"] for r in records.values()}) == 1  # one voice, the same id for both models


def test_a_voice_upload_warms_every_deployed_model(three_gateway, three_backend):
    with three_gateway.http() as http:
        created = upload(http, name="Thrice", audio=make_clip("wav", 1.5), transcript="Words to warm.")
    assert created.status_code == 200, created.text
    prepared = [r["model"] for r in _log(three_backend)
                if r["outcome"] == "prepared" and r["voice_id"] == created.json()["id"]]
    assert sorted(prepared) == sorted([contract.OFFLINE_MODEL, contract.SPARK_OFFLINE_MODEL,
                                       contract.COSYVOICE3_OFFLINE_MODEL])
