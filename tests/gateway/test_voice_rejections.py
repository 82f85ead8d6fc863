"""Every refused voice upload: its documented status, OpenAI error shape, code and param; nothing stored."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from starlette.requests import Request

from gateway.errors import InvalidRequest
from gateway.multipart import read_multipart
from tests.gateway.voice_clips import CLIP_FORMATS, encode_clip, make_clip, upload, voiced_signal

pytestmark = pytest.mark.triton

ERROR_KEYS = {"message", "type", "param", "code"}
#: A small upload limit for the size cases (the clips of the other cases stay below it).
UPLOAD_LIMIT = 400_000


BOUNDARY = "b0undary"
#: A multipart body up to the start of the audio file's bytes.
FILE_PART_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="name"\r\n\r\nchunky\r\n'
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="audio_sample"; filename="a.wav"\r\n\r\n'
).encode()


@pytest.fixture(scope="module")
def voice_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url, max_voice_upload_bytes=UPLOAD_LIMIT)


@pytest.fixture(scope="module")
def taken_name(voice_gateway) -> str:
    """An uploaded voice whose name and content later uploads collide with."""
    with voice_gateway.http() as http:
        assert upload(http, name="Taken", audio=make_clip("wav", 1.5), transcript="Taken words.").status_code == 200
    return "Taken"


def wav_of(samples: np.ndarray) -> bytes:
    """A 44.1 kHz stereo wav of ``samples``."""
    return encode_clip(samples, CLIP_FORMATS["wav"])


def mono_wav_seconds(seconds: float, **signal: float) -> bytes:
    return encode_clip(voiced_signal(8_000, seconds, **signal), CLIP_FORMATS["flac"])


CLIP = make_clip("wav", 1.5)
CASES = {
    # name
    "name missing": ({"name": None}, "name", "missing_required_parameter"),
    "name blank": ({"name": "   "}, "name", "missing_required_parameter"),
    "name too long": ({"name": "n" * 65}, "name", "string_above_max_length"),
    "name with slash": ({"name": "../etc/passwd"}, "name", "invalid_voice_name"),
    "name with backslash": ({"name": "a\\b"}, "name", "invalid_voice_name"),
    "name with control character": ({"name": "bell\x07"}, "name", "invalid_voice_name"),
    "name with newline": ({"name": "two\nlines"}, "name", "invalid_voice_name"),
    "name dot-dot": ({"name": ".."}, "name", "invalid_voice_name"),
    "name like an id": ({"name": "voice_mine"}, "name", "invalid_voice_name"),
    # transcript and consent
    "transcript too long": ({"transcript": "word " * 201}, "transcript", "string_above_max_length"),
    "transcript and ref_text differ": ({"ref_text": "Other words."}, "ref_text", "invalid_value"),
    "consent too long": ({"consent": "c" * 257}, "consent", "string_above_max_length"),
    # audio
    "audio missing": ({"audio": None}, "audio_sample", "missing_required_parameter"),
    "audio as a text field": ({"audio": None, "audio_sample": "not a file"}, "audio_sample", "invalid_type"),
    "audio undecodable": ({"audio": b"this is not audio at all" * 100}, "audio_sample", "invalid_audio"),
    "audio empty": ({"audio": b""}, "audio_sample", "invalid_audio"),
    "audio truncated": ({"audio": make_clip("mp3")[:200]}, "audio_sample", "invalid_audio"),
    "audio too short": ({"audio": mono_wav_seconds(0.6)}, "audio_sample", "audio_too_short"),
    "audio too long": ({"audio": mono_wav_seconds(31.0)}, "audio_sample", "audio_too_long"),
    "audio digital silence": ({"audio": wav_of(np.zeros(2 * 44_100, np.float32))}, "audio_sample", "audio_silent"),
    "audio nearly silent": ({"audio": mono_wav_seconds(2.0, level=0.004)}, "audio_sample", "audio_silent"),
    "audio too large": ({"audio": b"\0" * (UPLOAD_LIMIT + 1)}, "audio_sample", "file_too_large"),
    "body far too large": ({"audio": b"\0" * (3 * UPLOAD_LIMIT)}, "audio_sample", "file_too_large"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_upload_is_a_400_in_openai_shape(voice_gateway, case):
    overrides, param, code = CASES[case]
    fields = {"name": "fresh", "audio": CLIP, **overrides}
    before = voice_gateway.metric("tts_voice_upload_rejections_total", {"code": code})
    with voice_gateway.http() as http:
        response = upload(http, **fields)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
        assert error["message"]
        assert "fresh" not in {v["name"] for v in http.get("/v1/audio/voices").json()["voices"]}
    assert voice_gateway.metric("tts_voice_upload_rejections_total", {"code": code}) == before + 1
    assert not list(voice_gateway.settings.uploaded_voices_dir.glob("*fresh*"))


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"name": "alloy"}, "voice_name_taken"),  # an OpenAI voice name
        ({"name": "Amy"}, "voice_name_taken"),  # a shipped voice, case-insensitively
        ({"name": "TAKEN"}, "voice_name_taken"),  # an uploaded voice
        ({"name": "again", "audio": make_clip("wav", 1.5), "transcript": "Taken words."}, "voice_already_exists"),
    ],
)
def test_collisions_are_409(voice_gateway, taken_name, fields, code):
    files_before = sorted(voice_gateway.settings.uploaded_voices_dir.iterdir())
    with voice_gateway.http() as http:
        response = upload(http, **{"audio": make_clip("wav", 1.2), **fields})
    assert response.status_code == 409
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    assert sorted(voice_gateway.settings.uploaded_voices_dir.iterdir()) == files_before


def test_a_chunked_body_over_the_limit_is_refused(voice_gateway):
    """No Content-Length to check up front: the limit is enforced while the body arrives."""

    def body():
        yield FILE_PART_HEAD
        for _ in range(10):
            yield b"\0" * (UPLOAD_LIMIT // 4)
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    with voice_gateway.http() as http:
        response = http.post(
            "/v1/audio/voices", content=body(), headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
        )
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == ("audio_sample", "file_too_large")


def test_non_multipart_bodies_are_refused(voice_gateway):
    with voice_gateway.http() as http:
        response = http.post("/v1/audio/voices", json={"name": "json", "transcript": "hi"})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_content_type"
        broken = http.post(
            "/v1/audio/voices", content=b"--x\r\nnonsense", headers={"content-type": "multipart/form-data"}
        )
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == "invalid_multipart"


async def test_reading_stops_at_the_limit_of_an_endless_body():
    """The reader never consumes more than the limit (plus one chunk), however long the file is."""
    head = FILE_PART_HEAD
    chunk = b"\0" * 1024
    received = 0

    async def receive() -> dict:
        nonlocal received
        body = head if received == 0 else chunk
        received += len(body)
        await asyncio.sleep(0)
        return {"type": "http.request", "body": body, "more_body": True}

    scope = {
        "type": "http", "method": "POST", "path": "/v1/audio/voices",
        "headers": [(b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode())],
    }  # fmt: skip
    with pytest.raises(InvalidRequest) as caught:
        await read_multipart(Request(scope, receive), max_body_bytes=64 * 1024, file_param="audio_sample")
    assert caught.value.code == "file_too_large"
    assert 64 * 1024 < received <= 64 * 1024 + len(chunk)
