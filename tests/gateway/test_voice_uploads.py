"""Uploaded voices through the whole stack: httpx multipart upload -> gateway -> stand-in in a real
tritonserver, speech with the openai SDK, deletion, auth."""

from __future__ import annotations

import io
import json

import av
import numpy as np
import openai
import pytest

from tests.gateway.audio_checks import decode, dominant_frequency
from tests.gateway.voice_clips import CLIP_FORMATS, FUNDAMENTAL_HZ, make_clip, upload

pytestmark = pytest.mark.triton

CLIP_SECONDS = 2.0
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def voice_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url)


def letters(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalpha())


def stored_wav(gateway, voice_id: str) -> tuple[np.ndarray, int, int]:
    """Samples, rate and channel count of the file the gateway persisted for a voice."""
    data = (gateway.settings.uploaded_voices_dir / f"{voice_id}.wav").read_bytes()
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        channels = stream.codec_context.channels
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
    return samples, stream.rate, channels


@pytest.mark.parametrize("fmt", list(CLIP_FORMATS))
def test_uploaded_voice_is_listed_spoken_with_and_deleted(voice_gateway, standin_backend, fmt):
    clip = CLIP_FORMATS[fmt]
    name = f"Clip {fmt.upper()}"
    transcript = f"This is the {fmt} reference clip, spoken slowly."
    uploads_before = voice_gateway.metric("tts_voice_uploads_total")
    warmups_before = voice_gateway.metric("tts_voice_warmups_total", {"outcome": "ok"})
    with voice_gateway.http() as http:
        response = upload(
            http, name=name, audio=make_clip(fmt, CLIP_SECONDS), transcript=transcript,
            filename=f"me.{clip.suffix}", content_type=clip.content_type, consent="cons_1234",
        )  # fmt: skip
        assert response.status_code == 200, response.text
        created = response.json()
        assert set(created) == {"object", "id", "name", "created_at"}
        assert (created["object"], created["name"]) == ("audio.voice", name)
        voice_id = created["id"]
        assert voice_id.startswith("voice_")
        assert {"id": voice_id, "name": name} in http.get("/v1/audio/voices").json()["voices"]
        assert http.get(f"/v1/audio/voices/{voice_id}").json() == created
        assert http.get(f"/v1/audio/voices/{name.lower()}").json() == created  # names are case-insensitive
    assert voice_gateway.metric("tts_voice_uploads_total") == uploads_before + 1
    assert voice_gateway.metric("tts_voice_warmups_total", {"outcome": "ok"}) == warmups_before + 1

    # Converted once to 16 kHz mono and kept: the voiced signal's pitch and length survive.
    samples, rate, channels = stored_wav(voice_gateway, voice_id)
    assert (rate, channels) == (16_000, 1)
    assert CLIP_SECONDS - 0.01 <= samples.size / rate <= CLIP_SECONDS + 0.2  # codec priming/padding
    assert dominant_frequency(samples, rate) == pytest.approx(FUNDAMENTAL_HZ, abs=3)
    metadata = json.loads((voice_gateway.settings.uploaded_voices_dir / f"{voice_id}.json").read_text())
    assert (metadata["name"], metadata["transcript"], metadata["consent"]) == (name, transcript, "cons_1234")

    # The upload prepared the voice in the pipeline (empty target text)...
    [warmup] = [r for r in standin_backend.requests() if r["voice_id"] == voice_id]
    assert (warmup["target_text"], warmup["outcome"], warmup["model"]) == ("", "prepared", "cosyvoice2")
    assert warmup["voice_cached"] is False
    assert warmup["reference_wav_len"] == samples.size and warmup["reference_text"] == transcript

    # ...so speech with it, offline by id and streaming by name, hits the cache, naming the voice by id alone.
    offline_tag, stream_tag = f"zqoffline{letters(fmt)}", f"zqstream{letters(fmt)}"
    client = voice_gateway.client()
    audio = client.audio.speech.create(
        model="tts-1", voice={"id": voice_id}, input=f"{offline_tag} Hello from my cloned voice.",
        response_format="wav", extra_body={"stream": False},
    )  # fmt: skip
    produced, _ = decode(audio.content, "wav")
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice=name, input=f"{stream_tag} And now streaming.", response_format="mp3"
    ) as streamed:
        assert len(streamed.read()) > 0
    [offline] = standin_backend.requests_tagged(offline_tag)
    [streaming] = standin_backend.requests_tagged(stream_tag)
    assert (offline["model"], streaming["model"]) == ("cosyvoice2", "cosyvoice2_stream")
    assert produced.size == offline["samples"] > 0
    for record in (offline, streaming):
        assert record["voice_id"] == voice_id
        assert record["reference_text"] == transcript
        assert (record["carries_audio"], record["reference_wav_len"]) == (False, 0)
        assert record["voice_cached"] is True

    with voice_gateway.http() as http:
        deleted = http.delete(f"/v1/audio/voices/{voice_id}")
        assert deleted.json() == {"id": voice_id, "object": "audio.voice.deleted", "deleted": True}
        assert voice_gateway.metric("tts_voice_deletions_total") >= 1
        missing = http.get(f"/v1/audio/voices/{voice_id}")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "voice_not_found"
        assert voice_id not in {v["id"] for v in http.get("/v1/audio/voices").json()["voices"]}
        assert http.delete(f"/v1/audio/voices/{voice_id}").status_code == 404
    assert not list(voice_gateway.settings.uploaded_voices_dir.glob(f"{voice_id}.*"))
    for voice in ({"id": voice_id}, name):
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.speech.create(model="tts-1", voice=voice, input="Still there?")
        assert (caught.value.code, caught.value.param) == ("voice_not_found", "voice")


def test_transcript_may_be_sent_as_ref_text(voice_gateway, standin_backend):
    with voice_gateway.http() as http:
        response = upload(http, name="reftext", audio=make_clip("wav"), transcript=None, ref_text="Words as ref text.")
        assert response.status_code == 200, response.text
    voice_gateway.client().audio.speech.create(model="tts-1", voice="reftext", input="zqreftext Hi.")
    [record] = standin_backend.requests_tagged("zqreftext")
    assert record["reference_text"] == "Words as ref text."


@pytest.mark.parametrize("key", ["amy", "alloy", "AMY"])
def test_shipped_voices_cannot_be_deleted(voice_gateway, key):
    with voice_gateway.http() as http:
        amy = http.get("/v1/audio/voices/amy").json()
        for target in (key, amy["id"]):
            response = http.delete(f"/v1/audio/voices/{target}")
            assert response.status_code == 403
            error = response.json()["error"]
            assert set(error) == ERROR_KEYS
            assert (error["type"], error["code"]) == ("invalid_request_error", "voice_not_deletable")
        assert http.get(f"/v1/audio/voices/{amy['id']}").json()["name"] == "amy"


def test_unknown_voice_is_404(voice_gateway):
    with voice_gateway.http() as http:
        for method in ("GET", "DELETE"):
            response = http.request(method, "/v1/audio/voices/voice_000000000000000000000000")
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "voice_not_found"


# Auth -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_voice_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url, api_keys=["sk-voices"])


def test_voice_routes_require_the_api_key(keyed_voice_gateway):
    clip = make_clip("flac", 1.5)
    routes = [("GET", "/v1/audio/voices"), ("GET", "/v1/audio/voices/amy"), ("DELETE", "/v1/audio/voices/amy")]
    with keyed_voice_gateway.http() as http:
        for method, path in routes:
            response = http.request(method, path)
            assert response.status_code == 401, (method, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
        refused = upload(http, name="keyed", audio=clip)
        assert refused.status_code == 401
        http.headers["authorization"] = "Bearer sk-wrong"
        assert upload(http, name="keyed", audio=clip).status_code == 401
        assert http.get("/v1/audio/voices").status_code == 401
        http.headers["authorization"] = "Bearer sk-voices"
        created = upload(http, name="keyed", audio=clip)
        assert created.status_code == 200
        assert "keyed" in {v["name"] for v in http.get("/v1/audio/voices").json()["voices"]}
        assert http.delete(f"/v1/audio/voices/{created.json()['id']}").status_code == 200
    assert [p for p in keyed_voice_gateway.settings.uploaded_voices_dir.rglob("*") if p.is_file()] == []
