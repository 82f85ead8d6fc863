"""Hostile inputs against the stand-in: body limits, auth before parsing, content types, nothing-to-say,
run-on text, clients that leave mid-request, and quiet logs for aborted uploads."""

from __future__ import annotations

import logging
import socket
import unicodedata

import httpx
import openai
import pytest

from tests.gateway.conftest import wait_for
from tests.gateway.voice_clips import upload

pytestmark = pytest.mark.triton

ERROR_KEYS = {"message", "type", "param", "code"}
OK = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm"}
KEY = "sk-hardening"
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def small_gateway(standin_backend, gateway_factory):
    """One speech request at a time and a 256 KiB body limit: a leaked slot or a parsed giant body shows."""
    return gateway_factory(standin_backend.server.grpc_url, max_in_flight=1, max_request_bytes=BODY_LIMIT)


@pytest.fixture(scope="module")
def keyed_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url, api_keys=[KEY])


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    return error


def test_a_declared_body_above_the_limit_is_413_without_reading_it(small_gateway):
    junk = {**OK, "junk": "x" * (4 * BODY_LIMIT)}
    with small_gateway.http() as http:
        response = http.post("/v1/audio/speech", json=junk)
    assert response.status_code == 413
    assert _error(response)["code"] == "request_too_large"


def test_a_chunked_body_is_counted_as_it_arrives(small_gateway):
    def chunks():
        yield b'{"model": "tts-1", "voice": "alloy", "input": "hi", "junk": "'
        for _ in range(64):
            yield b"x" * 16384  # 1 MiB in all, no Content-Length
        yield b'"}'

    with small_gateway.http() as http:
        response = http.post("/v1/audio/speech", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and _error(response)["code"] == "request_too_large"
    assert small_gateway.metric("tts_requests_total", {"status": "413", "format": "unknown"}) >= 2


def test_bodies_below_the_limit_still_work(small_gateway):
    body = {**OK, "padding": "y" * (BODY_LIMIT // 2)}
    with small_gateway.http() as http:
        response = http.post("/v1/audio/speech", json=body)
    assert response.status_code == 200 and len(response.content) > 0


def test_the_api_key_is_checked_before_the_body_is_parsed(keyed_gateway):
    with keyed_gateway.http() as http:
        malformed = http.post("/v1/audio/speech", content=b'{"model": ', headers={"content-type": "application/json"})
        huge = http.post("/v1/audio/speech", json={**OK, "junk": "x" * (2 * 2**20)})
        keyed = http.post(
            "/v1/audio/speech", content=b'{"model": ',
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        )  # fmt: skip
    for response in (malformed, huge):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert _error(response)["code"] == "invalid_api_key"
    assert keyed.status_code == 400 and _error(keyed)["code"] == "invalid_json"


def test_a_wrong_key_is_401_with_the_scheme_named(keyed_gateway):
    with pytest.raises(openai.AuthenticationError) as caught:
        keyed_gateway.client(api_key="sk-wrong").audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
    assert caught.value.response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_json_body_with_the_wrong_content_type_says_so(gateway, content_type):
    with gateway.http() as http:
        response = http.post(
            "/v1/audio/speech", content=b'{"model": "tts-1", "input": "hi", "voice": "alloy"}',
            headers={"content-type": content_type} if content_type else {},
        )  # fmt: skip
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "invalid_content_type" and "application/json" in error["message"]


@pytest.mark.parametrize("text", ["?!... ,,, ;;; --- !!!", "😀 🎉 👍🏽", "— … —", "\u200b\u200b"])
def test_input_with_nothing_speakable_is_refused(gateway, text):
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().audio.speech.create(model="tts-1", voice="alloy", input=text)
    assert caught.value.param == "input" and "nothing to speak" in caught.value.message


@pytest.mark.parametrize(
    "text",
    [
        " ".join(["word"] * 300),
        ", ".join(["apples"] * 500)[:4000],
        "中文测试" * 140,
    ],
)
def test_run_on_text_is_cut_into_segments_the_pipeline_accepts(gateway, standin_backend, text):
    before = len(standin_backend.requests())
    audio = gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input=text, response_format="pcm", extra_body={"stream": False}
    )
    assert len(audio.content) > 0
    segments = [r["target_text"] for r in standin_backend.requests()[before:]]
    assert len(segments) > 1 and all(r["outcome"] == "done" for r in standin_backend.requests()[before:])
    assert all(len(unicodedata.normalize("NFC", s).encode()) <= 300 for s in segments)
    letters = lambda t: [c for c in t if c.isalnum()]  # noqa: E731
    assert letters("".join(segments)) == letters(text)  # cut, nothing lost or reordered


def test_a_client_leaving_a_non_streamed_request_frees_its_slot(small_gateway, standin_backend):
    body = {**OK, "input": "zqleaveoffline holdstream please", "stream": False}
    with httpx.Client(base_url=small_gateway.base_url, timeout=httpx.Timeout(30, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/audio/speech", json=body)  # leaves while the pipeline holds
    assert wait_for(lambda: small_gateway.metric("tts_in_flight_requests") == 0, 10)
    assert wait_for(lambda: small_gateway.metric("tts_requests_total", {"status": "499", "format": "pcm"}) >= 1, 30)
    # the pipeline stops too: the unary gRPC call is cancelled and the model sees is_cancelled()
    assert wait_for(lambda: standin_backend.marker("zqleaveoffline", "cancelled").exists(), 10)
    # the one slot is free again: the next request is served, not refused with 429
    audio = small_gateway.client().audio.speech.create(**{**OK, "input": "After the leaver."})
    assert len(audio.content) > 0
    standin_backend.release("zqleaveoffline")


def test_an_aborted_upload_logs_no_traceback(gateway, caplog):
    head = (
        b"--b0undary\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nhalf\r\n"
        b"--b0undary\r\nContent-Disposition: form-data; name=\"audio_sample\"; filename=\"a.wav\"\r\n\r\n"
        + b"\0" * 50_000
    )
    request = (
        b"POST /v1/audio/voices HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: multipart/form-data; boundary=b0undary\r\nContent-Length: 500000\r\n\r\n"
    )
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", gateway.settings.port)) as sock:
            sock.sendall(request + head)
        assert wait_for(lambda: any("client disconnected" in r.getMessage() for r in caplog.records), 10)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_an_undecodable_upload_gets_a_message_without_decoder_internals(gateway):
    with gateway.http() as http:
        response = upload(http, name="garbage", audio=b"this is not audio at all" * 100)
    assert response.status_code == 400
    message = _error(response)["message"]
    assert "Errno" not in message and "None" not in message and "could not be decoded" in message
