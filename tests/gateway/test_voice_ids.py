"""Voices by id (docs/pipeline-contract.md#voices-by-id): the gateway sends a voice's audio to a pipeline once and
names it by id afterwards; a pipeline that does not hold it answers [unknown_voice] before any audio and gets the
request again with the audio. Real tritonserver with the stand-in, real gateways, the OpenAI SDK and httpx."""

from __future__ import annotations

import httpx
import pytest

from gateway.triton_client import Pipeline, VoiceMemory
from tests.gateway.conftest import start_standin_backend, wait_for
from tests.gateway.standin_model.standin import samples_for, voice_cache_entry
from tests.gateway.voice_clips import make_clip, upload

TEXT = "Hello from a voice named by its id."


def test_the_voice_memory_is_bounded_per_pipeline_and_least_recently_used_goes_first():
    cosyvoice2, spark = Pipeline("cosyvoice2", "cosyvoice2_stream"), Pipeline("spark_tts", "spark_tts_stream")
    memory = VoiceMemory(capacity=2)
    memory.remember(cosyvoice2, "a")
    memory.remember(cosyvoice2, "b")
    assert memory.knows(cosyvoice2, "a")  # now the most recent
    memory.remember(cosyvoice2, "c")  # drops "b"
    assert [memory.knows(cosyvoice2, v) for v in "abc"] == [True, False, True]
    assert not memory.knows(spark, "a")  # each pipeline keeps its own voice cache
    memory.forget(cosyvoice2, "a")
    assert not memory.knows(cosyvoice2, "a")
    never = VoiceMemory(capacity=0)
    never.remember(cosyvoice2, "a")
    assert not never.knows(cosyvoice2, "a")


@pytest.fixture
def fresh_gateway(standin_backend, gateway_factory):
    """A gateway of its own: it has sent no voice to the stand-in yet."""
    return gateway_factory(standin_backend.server.grpc_url)


def uploaded_voice(gateway, name: str, seconds: float = 3.0) -> str:
    """A new voice, uploaded (its warm-up sends the audio to the pipeline); its id."""
    with gateway.http() as http:
        created = upload(http, name=name, audio=make_clip("wav", seconds, fundamental=110 + len(name)),
                         transcript=f"The words of {name}.")  # fmt: skip
    assert created.status_code == 200, created.text
    return created.json()["id"]


def speak(gateway, voice_id: str, text: str, mode: str) -> httpx.Response:
    body = {"model": "tts-1", "voice": {"id": voice_id}, "input": text, "response_format": "pcm"}
    body.update({"audio": {"stream": True}, "whole": {"stream": False}, "sse": {"stream_format": "sse"}}[mode])
    with gateway.http() as http:
        return http.post("/v1/audio/speech", json=body)


def forget(backend, voice_id: str) -> None:
    """The stand-in drops the voice (as a restarted or evicting pipeline, or a replica that never saw it)."""
    voice_cache_entry(backend.marker_dir, voice_id).unlink()


@pytest.mark.triton
def test_a_voice_travels_with_its_audio_once_then_by_id(fresh_gateway, standin_backend):
    voice_id = uploaded_voice(fresh_gateway, "Byid Once")
    [warmup] = [r for r in standin_backend.requests() if r["voice_id"] == voice_id]
    assert warmup["carries_audio"] and warmup["outcome"] == "prepared"
    client = fresh_gateway.client()
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice={"id": voice_id}, input=f"zqbyidstream {TEXT}", response_format="pcm"
    ) as streamed:
        streamed_bytes = len(streamed.read())
    whole = client.audio.speech.create(
        model="tts-1", voice={"id": voice_id}, input=f"zqbyidwhole {TEXT}", response_format="pcm",
        extra_body={"stream": False},
    )  # fmt: skip
    [stream_record] = standin_backend.requests_tagged("zqbyidstream")
    [whole_record] = standin_backend.requests_tagged("zqbyidwhole")
    for record, audio_bytes in ((stream_record, streamed_bytes), (whole_record, len(whole.content))):
        assert (record["carries_audio"], record["voice_cached"], record["outcome"]) == (False, True, "done")
        assert record["reference_wav_len"] == 0 and record["reference_text"] == "The words of Byid Once."
        assert audio_bytes == 2 * record["samples"] > 0
        # voice id, transcript and text: a few hundred bytes, where the audio alone was 4 bytes a sample
        assert record["request_bytes"] < 400
    assert warmup["request_bytes"] > 4 * warmup["reference_wav_len"] >= 4 * 3 * 16_000
    metric = fresh_gateway.metric
    assert metric("tts_pipeline_requests_total", {"voice": "with_audio"}) == 1  # the warm-up
    assert metric("tts_pipeline_requests_total", {"voice": "by_id"}) == 2
    assert metric("tts_pipeline_requests_total", {"voice": "resent_with_audio"}) == 0
    by_id_bytes = metric("tts_pipeline_request_bytes_total", {"voice": "by_id"})
    assert by_id_bytes == stream_record["request_bytes"] + whole_record["request_bytes"]  # what the pipeline got
    assert metric("tts_pipeline_request_bytes_total", {"voice": "with_audio"}) == warmup["request_bytes"]


@pytest.mark.triton
@pytest.mark.parametrize("mode", ["audio", "whole", "sse"])
def test_an_unknown_id_is_resent_once_with_the_audio(fresh_gateway, standin_backend, mode):
    voice_id = uploaded_voice(fresh_gateway, f"Byid Resend {mode}")
    forget(standin_backend, voice_id)
    tag = f"zqresend{mode}"
    response = speak(fresh_gateway, voice_id, f"{tag} {TEXT}", mode)
    assert response.status_code == 200, response.text
    refused, served = standin_backend.requests_tagged(tag)
    assert (refused["outcome"], refused["carries_audio"]) == ("unknown_voice", False)
    assert (served["outcome"], served["carries_audio"], served["voice_cached"]) == ("done", True, False)
    assert served["samples"] == samples_for(f"{tag} {TEXT}")
    if mode != "sse":
        assert len(response.content) == 2 * served["samples"]  # the audio once: nothing of the refused try
    assert fresh_gateway.metric("tts_pipeline_requests_total", {"voice": "resent_with_audio"}) == 1
    # the next request carries the audio once more (another replica may lack it too), then the id is enough
    for after in ("zqresendnext", "zqresendlast"):
        assert speak(fresh_gateway, voice_id, f"{after}{mode} {TEXT}", mode).status_code == 200
    [following] = standin_backend.requests_tagged(f"zqresendnext{mode}")
    [last] = standin_backend.requests_tagged(f"zqresendlast{mode}")
    assert following["carries_audio"] and not last["carries_audio"] and last["outcome"] == "done"


@pytest.mark.triton
@pytest.mark.parametrize("mode", ["audio", "whole", "sse"])
@pytest.mark.parametrize(
    "word, status, code", [("failstart", 500, "synthesis_failed"), ("overloaded", 503, "backend_overloaded")]
)
def test_a_failed_resend_is_an_openai_error_before_any_audio(fresh_gateway, standin_backend, mode, word, status, code):
    voice_id = uploaded_voice(fresh_gateway, f"Byid Fail {mode} {word}")
    forget(standin_backend, voice_id)
    tag = f"zqfailresend{mode}{word}"
    response = speak(fresh_gateway, voice_id, f"{tag} {word} {TEXT}", mode)
    assert response.status_code == status  # not a 200 with a cut body: nothing was sent yet
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "server_error" and error["message"]
    assert "unknown_voice" not in error["message"]  # the resend's own failure, not the refused first try
    refused, failed = standin_backend.requests_tagged(tag)
    assert (refused["outcome"], refused["carries_audio"]) == ("unknown_voice", False)
    assert (failed["outcome"], failed["carries_audio"]) == ("failed", True)


@pytest.mark.triton
def test_a_pipeline_refusing_a_voice_sent_with_its_audio_is_a_server_error(fresh_gateway, standin_backend):
    """[unknown_voice] for a request that carried the audio breaks the contract: one resend, then a 500."""
    voice_id = uploaded_voice(fresh_gateway, "Byid Refused")
    response = speak(fresh_gateway, voice_id, f"zqnoloop unknownvoice {TEXT}", "audio")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "synthesis_failed"
    assert [r["carries_audio"] for r in standin_backend.requests_tagged("zqnoloop")] == [False, True]


@pytest.mark.triton
def test_with_no_voice_memory_every_request_carries_the_audio(standin_backend, gateway_factory):
    gateway = gateway_factory(standin_backend.server.grpc_url, known_voices_per_model=0)
    voice_id = uploaded_voice(gateway, "Byid Never")
    for tag in ("zqnomemoryone", "zqnomemorytwo"):
        assert speak(gateway, voice_id, f"{tag} {TEXT}", "audio").status_code == 200
        [record] = standin_backend.requests_tagged(tag)
        assert record["carries_audio"] and record["voice_cached"]
    assert gateway.metric("tts_pipeline_requests_total", {"voice": "by_id"}) == 0


@pytest.mark.triton
def test_a_replica_that_never_saw_the_voice_gets_it_through_the_resend(
    standin_backend, gateway_factory, triton_server_factory, tmp_path_factory
):
    """Two tritonservers behind one round-robin target, each with its own voice cache."""
    other = start_standin_backend(triton_server_factory, tmp_path_factory.mktemp("replica"))
    replicas = (standin_backend, other)
    gateway = gateway_factory(f"ipv4:{standin_backend.server.grpc_url},{other.server.grpc_url}")
    with gateway.http() as http:
        assert wait_for(lambda: http.get("/ready").status_code == 200, timeout=30, interval=0.2)
    voice_id = uploaded_voice(gateway, "Byid Replicas")
    assert sum(voice_cache_entry(r.marker_dir, voice_id).exists() for r in replicas) == 1  # the warm-up's replica
    tags = [f"zqreplica{letter}" for letter in "abcdef"]
    for tag in tags:
        response = speak(gateway, voice_id, f"{tag} {TEXT}", "audio")
        assert response.status_code == 200, response.text
        assert len(response.content) == 2 * samples_for(f"{tag} {TEXT}")
    records = {tag: [r for replica in replicas for r in replica.requests_tagged(tag)] for tag in tags}
    for tag, tried in records.items():  # each request: served at once, or refused by id and then served with audio
        outcomes = sorted((r["outcome"], r["carries_audio"]) for r in tried)
        assert outcomes in ([("done", False)], [("done", True)], [("done", True), ("unknown_voice", False)]), tag
    assert any(r["outcome"] == "unknown_voice" for tried in records.values() for r in tried)
    assert all(voice_cache_entry(r.marker_dir, voice_id).exists() for r in replicas)  # both hold it now
    assert [r["carries_audio"] for r in records[tags[-1]]] == [False]  # and the id is enough again
