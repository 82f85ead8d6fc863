"""OpenAI-shaped errors: validation, unknown voice/model, auth, in-flight limit, model failures."""

from __future__ import annotations

import openai
import pytest

from triton_repo.server import REPO_ROOT
from tests.gateway.conftest import async_wait_for

pytestmark = pytest.mark.triton

OK = {"model": "tts-1", "input": "Hello there.", "voice": "alloy"}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("overrides", "exception", "param", "code"),
    [
        ({"input": ""}, openai.BadRequestError, "input", "string_below_min_length"),
        ({"input": "a" * 4097}, openai.BadRequestError, "input", "string_above_max_length"),
        ({"speed": 0.2}, openai.BadRequestError, "speed", "invalid_value"),
        ({"speed": 4.1}, openai.BadRequestError, "speed", "invalid_value"),
        ({"speed": "fast"}, openai.BadRequestError, "speed", "invalid_type"),
        ({"input": 42}, openai.BadRequestError, "input", "invalid_type"),
        ({"response_format": "ogg"}, openai.BadRequestError, "response_format", "invalid_value"),
        ({"stream_format": "chunks"}, openai.BadRequestError, "stream_format", "invalid_value"),
        ({"instructions": "x" * 4097}, openai.BadRequestError, "instructions", "string_above_max_length"),
        # 400, not 404: OpenAI's answer to an unsupported voice, and no router takes the deployment for broken
        ({"voice": "nobody"}, openai.BadRequestError, "voice", "voice_not_found"),
        ({"voice": {"id": "voice_nope"}}, openai.BadRequestError, "voice", "voice_not_found"),
        ({"voice": {"id": "amy", "extra": 1}}, openai.BadRequestError, "voice", "unknown_parameter"),
        ({"model": "tts-2"}, openai.NotFoundError, "model", "model_not_found"),
        ({"sample_rate": 16000}, openai.BadRequestError, "sample_rate", "unsupported_value"),
        ({"input": "?!"}, openai.BadRequestError, "input", "invalid_value"),
    ],
)
def test_invalid_requests_raise_the_matching_sdk_error(gateway, overrides, exception, param, code):
    body = {**OK, **overrides}
    with pytest.raises(exception) as caught:
        gateway.client().audio.speech.create(
            model=body.pop("model"), input=body.pop("input"), voice=body.pop("voice"), extra_body=body
        )
    assert caught.value.param == param
    assert caught.value.code == code
    assert set(caught.value.body) == ERROR_KEYS  # the SDK hands over the inner "error" object


@pytest.mark.parametrize(
    ("content", "param", "code"),
    [
        (b'{"model": "tts-1", "input": "hi", ', None, "invalid_json"),
        (b'{"model": "tts-1", "input": "hi"}', "voice", "missing_required_parameter"),
        (b'{"voice": "alloy", "input": "hi"}', "model", "missing_required_parameter"),
        (b'["not", "an", "object"]', None, "invalid_type"),
    ],
)
def test_malformed_bodies_are_400_in_openai_shape(gateway, content, param, code):
    with gateway.http() as http:
        response = http.post("/v1/audio/speech", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)


def test_voice_object_and_openai_names_resolve(gateway):
    voices = gateway.client().get("/audio/voices", cast_to=object)["voices"]
    amy = next(v for v in voices if v["name"] == "amy")
    for voice in ({"id": amy["id"]}, "amy", "alloy", amy["id"]):
        audio = gateway.client().audio.speech.create(model="tts-1", input="Hi there.", voice=voice, response_format="pcm")
        assert len(audio.content) > 0


def test_unknown_extension_fields_are_ignored_and_the_seed_reaches_the_model(gateway, standin_backend):
    audio = gateway.client().audio.speech.create(
        model="cosyvoice2", input="zqseed Hi there.", voice="alloy", response_format="pcm",
        extra_body={"lang_code": "en", "sample_rate": 24000, "seed": 2**63 + 7, "instructions": "calm"},
    )  # fmt: skip
    assert len(audio.content) > 0
    assert [r["seed"] for r in standin_backend.requests_tagged("zqseed")] == [2**63 + 7]


def test_the_model_receives_the_voice_as_the_contract_says(gateway_factory, standin_backend):
    gateway = gateway_factory(standin_backend.server.grpc_url)  # its own: it has sent no voice yet, so the audio goes
    voices = gateway.client().get("/audio/voices", cast_to=object)["voices"]
    clara = next(v for v in voices if v["name"] == "clara")
    gateway.client().audio.speech.create(model="tts-1", input="zqvoice Hello.", voice="coral", response_format="pcm")
    [record] = standin_backend.requests_tagged("zqvoice")
    assert record["voice_id"] == clara["id"]
    assert record["reference_text"] == (REPO_ROOT / "ref_audios" / "clara.txt").read_text().strip()
    assert record["carries_audio"] and record["reference_samples"] == record["reference_wav_len"]
    assert 3 * 16_000 <= record["reference_wav_len"] <= 8 * 16_000
    assert 0.01 < record["reference_rms"] < 1.0


@pytest.mark.parametrize(
    ("word", "exception", "status", "code"),
    [
        ("invalidinput", openai.BadRequestError, 400, "invalid_value"),
        ("overloaded", openai.InternalServerError, 503, "backend_overloaded"),
        ("failstart", openai.InternalServerError, 500, "synthesis_failed"),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
def test_model_errors_before_the_first_chunk_map_to_http_errors(gateway, word, exception, status, code, stream):
    with pytest.raises(exception) as caught:
        gateway.client().audio.speech.create(
            model="tts-1", input=f"{word} please.", voice="alloy", extra_body={"stream": stream}
        )
    assert caught.value.status_code == status
    assert caught.value.code == code
    headers = caught.value.response.headers
    if status == 503:
        assert headers["retry-after"] == str(gateway.settings.retry_after_s)
    if status == 500:
        assert headers["x-should-retry"] == "false"


def test_speech_requests_are_counted_by_status_and_format(gateway):
    before_ok = gateway.metric("tts_requests_total", {"status": "200", "format": "flac"})
    before_bad = gateway.metric("tts_requests_total", {"status": "400", "format": "unknown"})
    gateway.client().audio.speech.create(model="tts-1", input="Count me.", voice="alloy", response_format="flac")
    with pytest.raises(openai.BadRequestError):
        gateway.client().audio.speech.create(model="tts-1", input="", voice="alloy")
    assert gateway.metric("tts_requests_total", {"status": "200", "format": "flac"}) == before_ok + 1
    assert gateway.metric("tts_requests_total", {"status": "400", "format": "unknown"}) == before_bad + 1


# Auth -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url, api_keys=["sk-right", "sk-other"])


def test_missing_or_wrong_api_key_is_401_in_openai_shape(keyed_gateway):
    with keyed_gateway.http() as http:
        response = http.post("/v1/audio/speech", json=OK)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError) as caught:
        keyed_gateway.client(api_key="sk-wrong").audio.speech.create(**OK)
    assert (caught.value.code, caught.value.type) == ("invalid_api_key", "invalid_request_error")


def test_right_api_key_works(keyed_gateway):
    client = keyed_gateway.client(api_key="sk-other")
    assert len(client.audio.speech.create(**OK, response_format="pcm").content) > 0
    assert [m.id for m in client.models.list()] == keyed_gateway.settings.served_models


# In-flight limit --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_slot_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url, max_in_flight=1, retry_after_s=3)


async def test_in_flight_limit_answers_429_with_retry_after(single_slot_gateway, standin_backend):
    client = single_slot_gateway.async_client()
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", input="zqlimit holdstream a long enough sentence to hold.", voice="alloy", response_format="pcm"
    ) as held:
        body = held.iter_bytes()  # keep it referenced: a collected iterator closes the response
        assert await body.__anext__()
        assert await async_wait_for(standin_backend.marker("zqlimit", "holding").exists, timeout=10)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.audio.speech.create(model="tts-1", input="Second.", voice="alloy")
        assert caught.value.response.headers["retry-after"] == "3"
        assert caught.value.code == "rate_limit_exceeded"
        assert single_slot_gateway.metric("tts_in_flight_requests") == 1
        standin_backend.release("zqlimit")
        async for _ in body:
            pass
    assert await async_wait_for(lambda: single_slot_gateway.metric("tts_in_flight_requests") == 0, timeout=30)
    audio = await client.audio.speech.create(model="tts-1", input="Third.", voice="alloy", response_format="pcm")
    assert len(audio.content) > 0
