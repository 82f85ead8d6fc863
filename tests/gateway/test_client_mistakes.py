"""What a careless or hostile client is told: errors that say what to fix in the client's own words, never an
internal address or type name, one code per kind of mistake; and what the operator's log says of failures."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest

from tests.gateway.conftest import wait_for
from tests.gateway.voice_clips import make_clip, upload

pytestmark = pytest.mark.triton

OK = {"model": "tts-1", "input": "Hello there.", "voice": "alloy"}
ERROR_KEYS = {"message", "type", "param", "code"}


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    return error


# Paths -------------------------------------------------------------------------------------------
def test_a_path_without_v1_says_where_the_api_is(gateway):
    with gateway.http() as http:
        response = http.post("/audio/speech", json=OK)
        assert response.status_code == 404
        assert "Invalid URL (POST /audio/speech)" in _error(response)["message"]
        assert "POST /v1/audio/speech" in _error(response)["message"]
        voice = http.get("/audio/voices/amy")
        assert voice.status_code == 404 and "GET /v1/audio/voices/amy" in _error(voice)["message"]
        nowhere = http.get("/v1/nothing/here")
        assert nowhere.status_code == 404 and _error(nowhere)["message"] == "Invalid URL (GET /v1/nothing/here)."


def test_a_wrong_method_names_the_right_one(gateway):
    with gateway.http() as http:
        response = http.get("/v1/audio/speech")
    assert response.status_code == 405
    error = _error(response)
    assert error["code"] == "method_not_allowed" and "takes POST, not GET" in error["message"]


def test_the_favicon_is_no_error(gateway):
    with gateway.http() as http:
        assert http.get("/favicon.ico").status_code == 204


# Messages in the client's words ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("voice", "says"),
    [
        (123, "Invalid type for 'voice': give a voice name or id"),
        ({"id": ""}, "Invalid value for 'voice.id'"),
        ({"id": "amy", "extra": 1}, "Invalid value for 'voice.extra'"),
    ],
)
def test_validation_messages_name_fields_not_internal_types(gateway, voice, says):
    with gateway.http() as http:
        error = _error(http.post("/v1/audio/speech", json={**OK, "voice": voice}))
    assert error["param"] == "voice" and says in error["message"]
    assert not any(internal in error["message"] for internal in ("VoiceRef", "voice.str", "'str'"))


def test_deleting_an_alias_says_it_is_one(gateway):
    with gateway.http() as http:
        response = http.delete("/v1/audio/voices/alloy")
    assert response.status_code == 403
    assert _error(response)["message"].startswith("'alloy' is an alias of voice 'amy'")


def test_an_openai_voice_name_is_named_as_one_when_taken(gateway):
    with gateway.http() as http:
        response = upload(http, name="Nova", audio=make_clip("wav"))
    assert response.status_code == 409
    error = _error(response)
    assert error["code"] == "voice_name_taken" and "'Nova' is taken: it is an OpenAI voice name" in error["message"]
    assert "voice_" not in error["message"]  # not the id of the voice the alias points to


# One code per mistake ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "tts-1", "input": "hi", ',  # malformed
        b'{"model": "tts-1", "input": "\xff\xfe", "voice": "alloy"}',  # not UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # nested deeper than a parser follows
    ],
    ids=["malformed", "not utf-8", "deep nesting"],
)
def test_every_unreadable_body_is_invalid_json(gateway, content):
    with gateway.http() as http:
        response = http.post("/v1/audio/speech", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400 and _error(response)["code"] == "invalid_json"


@pytest.mark.parametrize("speed", ["NaN", "Infinity", "-Infinity"])
def test_a_speed_that_is_not_a_number_says_so(gateway, speed):
    content = ('{"model": "tts-1", "input": "hi", "voice": "alloy", "speed": %s}' % speed).encode()
    with gateway.http() as http:
        response = http.post("/v1/audio/speech", content=content, headers={"content-type": "application/json"})
    error = _error(response)
    assert (response.status_code, error["param"]) == (400, "speed") and "finite number" in error["message"]


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_a_cut_off_upload_says_it_was_cut_off(gateway, keep):
    boundary = "cutoffb0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\ncutoff\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="audio_sample"; filename="a.wav"\r\n\r\n'
    ).encode() + make_clip("wav") + f"\r\n--{boundary}--\r\n".encode()
    with gateway.http() as http:
        response = http.post(
            "/v1/audio/voices", content=body[: int(len(body) * keep)],
            headers={"content-type": f"multipart/form-data; boundary={boundary}"},
        )  # fmt: skip
        assert response.status_code == 400
        error = _error(response)
        assert error["code"] == "invalid_multipart" and "cut off" in error["message"]
        assert "cutoff" not in {v["name"] for v in http.get("/v1/audio/voices").json()["voices"]}


# No internal addresses ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def orphan_gateway(gateway_factory):
    """A gateway whose Triton is not there (nothing listens on its port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return gateway_factory(f"127.0.0.1:{port}"), port


def test_an_unreachable_backend_is_reported_without_its_address(orphan_gateway, caplog):
    gateway, port = orphan_gateway
    with caplog.at_level(logging.INFO, logger="gateway"), gateway.http() as http:
        for response in (http.get("/ready"), http.post("/v1/audio/speech", json={**OK, "stream": False})):
            assert response.status_code == 503
            error = _error(response)
            assert error["code"] == "backend_unavailable"
            assert not any(internal in error["message"] for internal in (str(port), "ipv4", "127.0.0.1"))
    # the operator still gets the details
    assert any(str(port) in record.getMessage() for record in caplog.records)


# The operator's log ------------------------------------------------------------------------------
def test_a_stream_cut_by_a_backend_failure_is_a_warning(gateway, caplog):
    with caplog.at_level(logging.INFO, logger="gateway"):
        with gateway.http() as http, pytest.raises(httpx.HTTPError):
            with http.stream("POST", "/v1/audio/speech", headers={"x-request-id": "req-cut-warn"},
                             json={**OK, "input": "failmid Cut off in the middle.", "response_format": "pcm"}
                             ) as response:  # fmt: skip
                assert response.status_code == 200
                for _ in response.iter_bytes():
                    pass

        def logged() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "request_id=req-cut-warn" in r.getMessage()]

        assert wait_for(lambda: any(r.getMessage().startswith("speech ") for r in logged()), 10)
    [line] = [r for r in logged() if r.getMessage().startswith("speech ")]
    assert line.levelno == logging.WARNING and "outcome=error 500" in line.getMessage()
