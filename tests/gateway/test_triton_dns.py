"""A `dns:///host:port` Triton URL (how the Kubernetes deployment names its headless Service) works end to end."""

from __future__ import annotations

import pytest

from tests.gateway.conftest import wait_for

pytestmark = pytest.mark.triton


def test_a_dns_target_reaches_triton(standin_backend, gateway_factory):
    gateway = gateway_factory(f"dns:///{standin_backend.server.grpc_url}")
    with gateway.http() as http:
        # the channel resolves and connects on first use, which a loaded machine may not finish within one
        # readiness check's deadline (TTS_READY_TIMEOUT_S): poll
        assert wait_for(lambda: http.get("/ready").status_code == 200, timeout=30, interval=0.2)
    audio = gateway.client().audio.speech.create(model="tts-1", voice="amy", input="zqdnstarget Hello.")
    assert len(audio.content) > 0
    [record] = standin_backend.requests_tagged("zqdnstarget")
    assert record["model"] == "cosyvoice2_stream"
