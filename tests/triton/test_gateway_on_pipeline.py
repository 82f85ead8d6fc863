"""The gateway's contract through the real pipeline (OpenAI SDK -> gateway -> tritonserver -> tiny model)."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest

from tests.gateway.audio_checks import decode
from tests.triton.conftest import SAMPLES_PER_TOKEN

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def real_gateway(pipeline, gateway_factory):
    return gateway_factory(pipeline.server.grpc_url)


@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_decodes_and_lossless_ones_hold_whole_tokens(real_gateway, response_format):
    data = real_gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the real pipeline.", response_format=response_format
    ).read()
    samples, rate = decode(data, response_format)
    assert samples.size > 0 and rate in (24_000, 48_000)  # opus decodes at 48 kHz
    if response_format in ("wav", "pcm", "flac"):
        assert rate == 24_000 and samples.size % SAMPLES_PER_TOKEN == 0  # 960 samples per speech token


def test_sse_usage_is_the_pipelines_token_count(real_gateway):
    with real_gateway.client().audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="coral", input="Usage flows from the pipeline to the client.",
        response_format="pcm", stream_format="sse",
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done" and len(events) >= 3  # several deltas: streamed, not buffered
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    samples, _ = decode(audio, "pcm")
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and samples.size == usage["output_tokens"] * SAMPLES_PER_TOKEN


def test_streamed_speech_arrives_in_several_pieces(real_gateway):
    pieces = []
    with real_gateway.client().audio.speech.with_streaming_response.create(
        model="tts-1", voice="nova", input="Streaming through the gateway and the real pipeline.", response_format="pcm"
    ) as response:
        for piece in response.iter_bytes(4096):
            pieces.append(piece)
    samples, _ = decode(b"".join(pieces), "pcm")
    assert len(pieces) > 1 and samples.size > 0


def test_empty_input_is_a_400(real_gateway):
    with pytest.raises(openai.BadRequestError):
        real_gateway.client().audio.speech.create(model="tts-1", voice="alloy", input="   ")


def test_captions_and_instructions_through_the_real_pipeline(real_gateway):
    """Instruct mode runs end to end, and every caption ends on a whole speech token of the real audio."""
    filler = " ".join(["and the words keep coming"] * 12)
    text = f"The first sentence {filler}. The second sentence {filler}."  # two segments (about 65 tokens each)
    with httpx.Client(base_url=real_gateway.base_url, timeout=600) as http:
        response = http.post("/v1/audio/speech/captioned", json={
            "model": "gpt-4o-mini-tts", "voice": "alloy", "input": text, "response_format": "wav",
            "instructions": "Speak slowly.", "seed": 7,
        })
    assert response.status_code == 200, response.text
    body = response.json()
    samples, rate = decode(base64.b64decode(body["audio"]), "wav")
    captions = body["captions"]
    assert rate == 24_000 and len(captions) >= 2
    assert captions[-1]["end"] * rate == pytest.approx(samples.size, abs=1e-6)
    for caption in captions:
        assert round(caption["end"] * rate) % SAMPLES_PER_TOKEN == 0
    assert body["usage"]["output_tokens"] * SAMPLES_PER_TOKEN == samples.size
