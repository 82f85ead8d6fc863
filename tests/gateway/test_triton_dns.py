"""A `dns:///host:port` Triton URL (how the Kubernetes deployment names its headless Service) works end to end."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.triton


def test_a_dns_target_reaches_triton(standin_backend, gateway_factory):
    gateway = gateway_factory(f"dns:///{standin_backend.server.grpc_url}")
    with gateway.http() as http:
        assert http.get("/ready").status_code == 200
    audio = gateway.client().audio.speech.create(model="tts-1", voice="amy", input="zqdnstarget Hello.")
    assert len(audio.content) > 0
    [record] = standin_backend.requests_tagged("zqdnstarget")
    assert record["model"] == "cosyvoice2_stream"
