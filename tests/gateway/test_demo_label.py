"""Demo mode (`TTS_DEMO`): every response is labelled and the model lists lead with the demo id; off by default."""

from __future__ import annotations

import logging

import pytest

from gateway.demo import DEMO_HEADER, DEMO_HEADER_VALUE, DEMO_MODEL_ID
from gateway.settings import Settings


def test_the_demo_labels_every_response_and_lists_its_model_first(standin_backend, gateway_factory, caplog):
    with caplog.at_level(logging.WARNING, logger="gateway.app"):
        demo = gateway_factory(standin_backend.server.grpc_url, demo=True)
    client = demo.client()
    models = client.models.with_raw_response.list()
    assert models.headers[DEMO_HEADER] == DEMO_HEADER_VALUE
    assert [m.id for m in models.parse().data][0] == DEMO_MODEL_ID
    speech = client.audio.speech.with_raw_response.create(
        model=DEMO_MODEL_ID, voice="alloy", input="zqdemolabel Labelled words.", response_format="wav"
    )
    assert speech.headers[DEMO_HEADER] == DEMO_HEADER_VALUE and speech.content[:4] == b"RIFF"
    with demo.http() as http:
        assert http.get("/v1/audio/models").json()["models"][0]["id"] == DEMO_MODEL_ID
        refused = http.post("/v1/audio/speech", json={"model": "nope", "voice": "alloy", "input": "x"})
        for response in (refused, http.get("/health"), http.get("/metrics"), http.get("/playground")):
            assert response.headers.get(DEMO_HEADER) == DEMO_HEADER_VALUE, response.url
    assert refused.status_code == 404
    banner = "\n".join(r.getMessage() for r in caplog.records if "DEMO MODE" in r.getMessage())
    assert f"http://127.0.0.1:{demo.settings.port}/v1" in banner and DEMO_MODEL_ID in banner


def test_without_the_demo_nothing_is_labelled(gateway):
    with gateway.http() as http:
        for response in (http.get("/v1/models"), http.get("/health")):
            assert DEMO_HEADER not in response.headers
        assert DEMO_MODEL_ID not in {m["id"] for m in http.get("/v1/models").json()["data"]}


@pytest.mark.parametrize("served", [["tts-1"], [DEMO_MODEL_ID, "tts-1"]])
def test_the_demo_id_is_listed_once(served):
    settings = Settings(demo=True, served_models=served, _env_file=None)
    assert settings.served_models.count(DEMO_MODEL_ID) == 1 and settings.served_models[0] == DEMO_MODEL_ID
