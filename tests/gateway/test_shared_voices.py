"""Gateway replicas sharing one uploaded-voices directory (the Kubernetes deployment's volume): a voice uploaded
through one replica is found by the others on first use, by name or id, without a restart."""

from __future__ import annotations

import pytest

from tests.gateway.voice_clips import make_clip, upload

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def replicas(standin_backend, gateway_factory, tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared_voices")
    url = standin_backend.server.grpc_url
    return gateway_factory(url, uploaded_voices_dir=shared), gateway_factory(url, uploaded_voices_dir=shared)


def test_a_voice_uploaded_on_one_replica_is_spoken_by_another(replicas, standin_backend):
    first, second = replicas
    with first.http() as http:
        response = upload(http, name="Shared Voice", audio=make_clip("wav", 1.5), transcript="Shared words.")
        assert response.status_code == 200, response.text
        voice_id = response.json()["id"]
    with second.http() as http:
        # the other replica re-reads the shared directory: listed, and found by id, at once
        assert "Shared Voice" in {v["name"] for v in http.get("/v1/audio/voices").json()["voices"]}
        assert http.get(f"/v1/audio/voices/{voice_id}").json()["name"] == "Shared Voice"
    second.client().audio.speech.create(model="tts-1", voice="shared voice", input="zqsharedname Hi.")
    [record] = standin_backend.requests_tagged("zqsharedname")
    assert record["voice_id"] == voice_id and record["reference_text"] == "Shared words."
    with second.http() as http:
        assert "Shared Voice" in {v["name"] for v in http.get("/v1/audio/voices").json()["voices"]}
        # the name is taken for every replica, not only the one that stored it
        clash = upload(http, name="shared VOICE", audio=make_clip("wav", 1.2), transcript="Other words.")
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "voice_name_taken"
        assert http.delete(f"/v1/audio/voices/{voice_id}").status_code == 200
        assert http.get(f"/v1/audio/voices/{voice_id}").status_code == 404


def test_unknown_and_malformed_keys_stay_404(replicas):
    _, second = replicas
    with second.http() as http:
        for key in ("voice_0123456789abcdef01234567", "voice_..%2F..%2Fetc", "nobody at all"):
            assert http.get(f"/v1/audio/voices/{key}").status_code == 404
