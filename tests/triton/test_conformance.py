"""One pipeline-contract conformance suite, run against BOTH the stand-in model (tests/gateway/standin_model)
and the real pipeline on the tiny model, so the test double and the real thing cannot drift apart again:
the warm-up rule, the error tags, voices by id, cancellation, usage counts (docs/pipeline-contract.md)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferenceServerException

from tests.gateway.conftest import standin_backend  # noqa: F401 - the stand-in as a fixture here too
from gateway.services.voice_store import wav_bytes
from tests.gateway.voice_clips import make_clip, upload, voiced_signal
from tests.triton.conftest import SAMPLES_PER_TOKEN, synthesis_inputs
import pipeline_contract as contract

pytestmark = pytest.mark.triton


@dataclass
class ContractBackend:
    name: str
    grpc_url: str
    cancelled: Callable[[str], int]  # requests the model (offline or streaming) saw cancelled so far
    release: Callable[[str], None]  # let a stand-in request held by `holdstream` go (no-op for the pipeline)


@pytest.fixture(scope="module", params=["standin", "pipeline"])
def backend(request) -> ContractBackend:
    if request.param == "standin":
        standin = request.getfixturevalue("standin_backend")
        return ContractBackend(
            "standin",
            standin.server.grpc_url,
            lambda model: sum(1 for r in standin.requests() if r["outcome"] == "cancelled" and r["model"] == model),
            standin.release,
        )
    pipeline = request.getfixturevalue("pipeline")
    return ContractBackend(
        "pipeline",
        pipeline.server.grpc_url,
        lambda model: int(pipeline.metrics().get(("orchestrator_cancelled_total", model), 0)),
        lambda tag: None,
    )


@pytest.fixture(scope="module")
def contract_gateway(backend, gateway_factory):
    return gateway_factory(backend.grpc_url)


async def _offline(url: str, inputs: list) -> object:
    async with grpcclient.InferenceServerClient(url) as client:
        return await client.infer(contract.OFFLINE_MODEL, inputs)


async def _stream(url: str, inputs: list) -> list[tuple[np.ndarray, int, int, bool]]:
    async def requests():
        yield {"model_name": contract.STREAMING_MODEL, "inputs": inputs}

    out = []
    async with grpcclient.InferenceServerClient(url) as client:
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            out.append((
                result.as_numpy(contract.WAVEFORM.name),
                int(result.as_numpy(contract.INPUT_TOKENS.name)[0]),
                int(result.as_numpy(contract.OUTPUT_TOKENS.name)[0]),
                final,
            ))  # fmt: skip
            if final:
                break
    return out


# -- the warm-up rule ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "   "])
def test_empty_target_text_only_prepares_the_voice(backend, text):
    result = asyncio.run(_offline(backend.grpc_url, synthesis_inputs(text, voice=f"warm-{backend.name}")))
    assert result.as_numpy(contract.WAVEFORM.name).size == 0
    tokens = (result.as_numpy(contract.INPUT_TOKENS.name)[0], result.as_numpy(contract.OUTPUT_TOKENS.name)[0])
    assert tuple(map(int, tokens)) == (0, 0)
    [(waveform, tokens_in, tokens_out, final)] = asyncio.run(_stream(backend.grpc_url, synthesis_inputs(text)))
    assert (waveform.size, tokens_in, tokens_out, final) == (0, 0, 0, True)


def test_a_voice_upload_warms_the_voice(contract_gateway):
    with contract_gateway.http() as http:
        created = upload(http, name="Warmed", audio=make_clip("wav", 1.5), transcript="Words to warm.")
    assert created.status_code == 200, created.text
    assert contract_gateway.metric("tts_voice_warmups_total", {"outcome": "ok"}) == 1
    assert contract_gateway.metric("tts_voice_warmups_total", {"outcome": "failed"}) == 0
    speech = contract_gateway.client().audio.speech.create(
        model="tts-1", voice="warmed", input="Hi.", response_format="pcm"
    )
    assert len(speech.content) > 0


# -- error tags ----------------------------------------------------------------------------------------------------
def _too_short_reference() -> list:
    inputs = synthesis_inputs("Hello.", seconds=0.05)
    return inputs


@pytest.mark.parametrize(
    "inputs", [_too_short_reference, lambda: synthesis_inputs("word " * (contract.MAX_SEGMENT_TOKENS + 20))],
    ids=["reference under 0.1 s", "segment above the token limit"],
)  # fmt: skip
def test_input_the_pipeline_refuses_is_tagged_invalid_input(backend, inputs):
    with pytest.raises(InferenceServerException, match=r"\[invalid_input\]"):
        asyncio.run(_offline(backend.grpc_url, inputs()))
    with pytest.raises(InferenceServerException, match=r"\[invalid_input\]"):
        asyncio.run(_stream(backend.grpc_url, inputs()))


# -- usage ---------------------------------------------------------------------------------------------------------
def test_sse_usage_is_the_pipelines_count_and_matches_the_audio(contract_gateway):
    text = "Usage flows from the pipeline to the client."
    with contract_gateway.client().audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=text, response_format="pcm", stream_format="sse"
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert len(audio) == 2 * usage["output_tokens"] * SAMPLES_PER_TOKEN  # whole speech tokens, all of them sent


# -- cancellation --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole file"])
def test_a_client_leaving_cancels_the_request_in_the_pipeline(contract_gateway, backend, stream):
    model = contract.STREAMING_MODEL if stream else contract.OFFLINE_MODEL
    before = backend.cancelled(model)
    tag = f"zqleave{backend.name}{'stream' if stream else 'whole'}"
    # Thirty sentences: a real model may end each one early (at its minimum of speech tokens per text token), and
    # the whole file must still take far longer than the client's one-second read timeout.
    story = " ".join(["Please keep on talking for quite a while, it is a long story."] * 30)
    body = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "stream": stream,
            "input": f"{tag} holdstream {story}"}  # fmt: skip
    with httpx.Client(base_url=contract_gateway.base_url, timeout=httpx.Timeout(120, read=1.0)) as http:
        if stream:
            with http.stream("POST", "/v1/audio/speech", json=body) as response:
                assert response.status_code == 200
                next(response.iter_bytes())  # the first audio, then leave
        else:
            with pytest.raises(httpx.ReadTimeout):  # leaves while the whole file is being made
                http.post("/v1/audio/speech", json=body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and backend.cancelled(model) <= before:
        time.sleep(0.1)
    backend.release(tag)
    assert backend.cancelled(model) > before
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and contract_gateway.metric("tts_in_flight_requests"):
        time.sleep(0.1)
    assert contract_gateway.metric("tts_in_flight_requests") == 0


# -- voices by id --------------------------------------------------------------------------------------------------
async def _stream_until_error(url: str, inputs: list) -> tuple[int, InferenceServerException | None]:
    """(audio samples received, the error that ended the stream, if any)."""
    samples = 0
    try:
        for waveform, _, _, _ in await _stream(url, inputs):
            samples += waveform.size
    except InferenceServerException as exc:
        return samples, exc
    return samples, None


def test_an_id_only_request_for_a_voice_not_held_is_refused_before_any_audio(backend):
    voice = f"never-sent-{backend.name}"
    with pytest.raises(InferenceServerException, match=r"\[unknown_voice\]"):
        asyncio.run(_offline(backend.grpc_url, synthesis_inputs("Hello.", voice=voice, by_id=True)))
    samples, error = asyncio.run(_stream_until_error(backend.grpc_url, synthesis_inputs("Hello.", voice=voice,
                                                                                         by_id=True)))
    assert samples == 0 and error is not None and "[unknown_voice]" in error.message()
    # the warm-up rule by id alone checks the voice is held: refused alike
    with pytest.raises(InferenceServerException, match=r"\[unknown_voice\]"):
        asyncio.run(_offline(backend.grpc_url, synthesis_inputs("", voice=voice, by_id=True)))


def test_an_id_only_request_for_a_held_voice_is_served_by_both_models(backend):
    voice = f"sent-once-{backend.name}"
    asyncio.run(_offline(backend.grpc_url, synthesis_inputs("", voice=voice)))  # the audio once: the warm-up
    offline = asyncio.run(_offline(backend.grpc_url, synthesis_inputs("Hello by id.", voice=voice, by_id=True)))
    assert offline.as_numpy(contract.WAVEFORM.name).size > 0
    chunks = asyncio.run(_stream(backend.grpc_url, synthesis_inputs("Hello by id.", voice=voice, by_id=True)))
    assert chunks[-1][3] and sum(c[0].size for c in chunks) > 0


#: The gateway's response modes: streamed audio, the whole file, SSE events.
MODES = {"audio": {"stream": True}, "whole": {"stream": False}, "sse": {"stream_format": "sse"}}


@pytest.fixture(scope="module")
def voice_gateway(backend, gateway_factory, tmp_path_factory):
    """A gateway whose voices are `fine<mode>` (1.5 s, one per response mode: each test needs a voice the pipeline
    has never seen) and `tiny` (0.05 s: under the pipeline's reference minimum)."""
    voices = tmp_path_factory.mktemp(f"voices-{backend.name}")
    clips = {f"fine{mode}": voiced_signal(16_000, 1.5, fundamental=120 + 10 * i) for i, mode in enumerate(MODES)}
    for name, samples in {**clips, "tiny": voiced_signal(16_000, 0.05)}.items():
        (voices / f"{name}.wav").write_bytes(wav_bytes(samples))
    return gateway_factory(backend.grpc_url, voices_dir=voices, voice_aliases={})


def _believe_held(gateway, name: str) -> None:
    """The gateway takes the voice as held by the pipeline without having sent it (as after a pipeline restart, an
    eviction, or with a replica that never saw it): its next request names it by id alone."""
    with gateway.http() as http:
        voice_id = next(v["id"] for v in http.get("/v1/audio/voices").json()["voices"] if v["name"] == name)
    triton = gateway.app.state.triton
    triton.voices.remember(triton.pipeline, voice_id)


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_id_is_resent_with_the_audio_and_served(voice_gateway, mode):
    _believe_held(voice_gateway, f"fine{mode}")
    resent = voice_gateway.metric("tts_pipeline_requests_total", {"voice": "resent_with_audio"})
    body = {"model": "tts-1", "voice": f"fine{mode}", "input": "Served after one resend.", "response_format": "pcm",
            **MODES[mode]}
    with voice_gateway.http() as http:
        response = http.post("/v1/audio/speech", json=body)
    assert response.status_code == 200, response.text
    if mode == "sse":
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
        audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    else:
        audio = response.content
    assert len(audio) > 0 and len(audio) % (2 * SAMPLES_PER_TOKEN) == 0  # whole tokens, each once
    assert voice_gateway.metric("tts_pipeline_requests_total", {"voice": "resent_with_audio"}) == resent + 1


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_id_whose_resend_fails_is_an_openai_error_before_any_audio(voice_gateway, mode):
    _believe_held(voice_gateway, "tiny")
    body = {"model": "tts-1", "voice": "tiny", "input": "Never spoken.", "response_format": "pcm", **MODES[mode]}
    with voice_gateway.http() as http:
        response = http.post("/v1/audio/speech", json=body)
    assert response.status_code == 400  # the resend's own refusal (the reference is too short), not a 200
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
    assert "reference_wav_len" in error["message"] and "unknown_voice" not in error["message"]
