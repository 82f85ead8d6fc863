"""Client disconnects, Triton going away and coming back, probes."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import async_wait_for, start_standin_backend, wait_for

pytestmark = pytest.mark.triton


async def test_client_disconnect_cancels_the_triton_request(gateway, standin_backend):
    client = gateway.async_client()
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", input="zqdisconnect holdstream tell me a long story please.", voice="alloy",
        response_format="mp3",
    ) as response:  # fmt: skip
        body = response.iter_bytes()
        assert await body.__anext__()
        assert await async_wait_for(standin_backend.marker("zqdisconnect", "holding").exists, timeout=10)
        assert gateway.metric("tts_in_flight_requests") >= 1
    # Leaving the block closes the connection mid-stream; the model must see the cancellation (well before its
    # hold would time out and fail the request instead; a loaded CI machine may take seconds to pass it on).
    assert await async_wait_for(standin_backend.marker("zqdisconnect", "cancelled").exists, timeout=15)
    assert [r["outcome"] for r in standin_backend.requests_tagged("zqdisconnect")] == ["cancelled"]
    assert await async_wait_for(lambda: gateway.metric("tts_in_flight_requests") == 0, timeout=30)


def test_health_is_public_and_ready_checks_both_models(gateway):
    with gateway.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/ready").json() == {"status": "ready"}


def test_gateway_recovers_when_triton_restarts_on_the_same_ports(
    triton_server_factory, gateway_factory, tmp_path_factory
):
    backend = start_standin_backend(triton_server_factory, tmp_path_factory.mktemp("restart"))
    gateway = gateway_factory(backend.server.grpc_url, retry_after_s=2)
    client = gateway.client()
    assert len(client.audio.speech.create(model="tts-1", input="Before.", voice="alloy", response_format="pcm").content)

    backend.server.stop()
    with gateway.http() as http:
        ready = http.get("/ready")
    assert ready.status_code == 503
    assert ready.headers["retry-after"] == "2"
    assert ready.json()["error"]["code"] == "backend_unavailable"
    with pytest.raises(openai.InternalServerError) as caught:
        client.audio.speech.create(model="tts-1", input="During.", voice="alloy")
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "2"
    assert caught.value.code == "backend_unavailable"
    with gateway.http() as http:
        assert http.get("/health").status_code == 200  # liveness does not depend on Triton

    backend.server.start()  # same ports
    with gateway.http() as http:
        assert wait_for(lambda: http.get("/ready").status_code == 200, timeout=60, interval=0.1)
    audio = client.audio.speech.create(model="tts-1", input="After.", voice="alloy", response_format="pcm")
    assert len(audio.content) > 0
