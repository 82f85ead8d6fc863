"""The gateway's contract through the real pipeline (OpenAI SDK -> gateway -> tritonserver -> tiny model)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.audio_checks import decode
from tests.gateway.conftest import gateway_factory  # noqa: F401 - the gateway test rig, reused

pytestmark = pytest.mark.triton

SAMPLES_PER_TOKEN = 960


@pytest.fixture(scope="module")
def real_gateway(pipeline, gateway_factory):
    return gateway_factory(pipeline.server.grpc_url)


@pytest.mark.parametrize("response_format", ["wav", "pcm"])
def test_speech_from_the_real_pipeline_is_whole_tokens_of_24k_audio(real_gateway, response_format):
    data = real_gateway.client().audio.speech.create(
        model="tts-1", voice="alloy", input="Hello from the real pipeline.", response_format=response_format
    ).read()
    samples, rate = decode(data, response_format)
    assert rate == 24_000 and samples.size > 0
    assert samples.size % SAMPLES_PER_TOKEN == 0  # one segment: 960 samples per generated speech token


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
