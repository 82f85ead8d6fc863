"""The calls popular clients really make, replayed with the HTTP libraries they use (docs/clients.md).

* Open WebUI (TTS engine "OpenAI"): ``requests.get({base}/audio/models)`` and ``requests.get({base}/audio/voices)``
  WITHOUT an Authorization header to fill its menus (falling back to tts-1/alloy… when they fail), then an
  aiohttp ``POST {base}/audio/speech`` with ``{"input", "voice", "model"}`` plus its ``TTS_OPENAI_PARAMS``,
  ``Authorization: Bearer <its key>`` (empty key: ``"Bearer "``), reading the whole body.
* Home Assistant's OpenAI TTS integration: the URL is the full speech endpoint; it lists voices at the sibling
  ``…/voices?limit=100`` and POSTs ``{"model", "input", "voice", "response_format": "mp3", "speed"}`` (+
  ``instructions``) with urllib, or streams ``response_format: "opus"`` with aiohttp.
* LiteLLM's proxy (``model: openai/<id>`` + ``api_base``): the OpenAI SDK's ``audio.speech.create`` with the
  ``openai/`` prefix stripped and only the parameters its caller set.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest
import requests

from tests.gateway.audio_checks import decode

pytestmark = pytest.mark.triton

OPEN_WEBUI_FALLBACK_MODELS = [{"id": "tts-1"}, {"id": "tts-1-hd"}]
OPEN_WEBUI_FALLBACK_VOICES = {v: v for v in ("alloy", "echo", "fable", "onyx", "nova", "shimmer")}
API_KEY = "sk-clients-test"


@pytest.fixture(scope="module")
def keyed_gateway(standin_backend, gateway_factory):
    return gateway_factory(standin_backend.server.grpc_url, api_keys=[API_KEY])


def open_webui_menus(base: str) -> tuple[list[dict], dict[str, str]]:
    """Open WebUI's get_available_models / get_available_voices for a non-OpenAI base URL."""
    try:
        response = requests.get(f"{base}/audio/models", timeout=10)
        response.raise_for_status()
        models = response.json().get("models", [])
    except requests.RequestException:
        models = OPEN_WEBUI_FALLBACK_MODELS
    try:
        response = requests.get(f"{base}/audio/voices", timeout=10)
        response.raise_for_status()
        voices = {voice["id"]: voice["name"] for voice in response.json().get("voices", [])}
    except requests.RequestException:
        voices = OPEN_WEBUI_FALLBACK_VOICES
    return models, voices


async def open_webui_speech(base: str, api_key: str, payload: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
        async with session.post(f"{base}/audio/speech", json=payload, headers=headers) as response:
            return response.status, await response.read()


def test_open_webui_fills_its_menus_and_speaks_with_what_it_picked(gateway, standin_backend):
    base = f"{gateway.base_url}/v1"
    models, voices = open_webui_menus(base)
    assert [m["id"] for m in models] == gateway.settings.served_models  # our list, not Open WebUI's fallback
    assert sorted(voices.values()) == ["amy", "ben", "clara", "dave"]
    voice_id = next(i for i, name in voices.items() if name == "clara")
    # the chat UI sends {"input", "voice"}; the backend sets "model" and merges TTS_OPENAI_PARAMS
    payload = {"input": "zqopenwebui Hello from the chat.", "voice": voice_id, "model": models[0]["id"], "speed": 1.25}
    status, body = asyncio.run(open_webui_speech(base, "", payload))  # no key configured in Open WebUI
    assert status == 200
    audio, rate = decode(body, "mp3")  # it stores the reply as .mp3: the default format must be mp3
    assert rate == 24_000 and audio.size > 0
    [record] = standin_backend.requests_tagged("zqopenwebui")
    assert record["voice_id"] == voice_id and record["model"] == "cosyvoice2_stream"


def test_open_webui_with_api_keys_falls_back_to_openai_names_that_we_serve(keyed_gateway, standin_backend):
    base = f"{keyed_gateway.base_url}/v1"
    models, voices = open_webui_menus(base)  # its listing requests carry no key: 401, so it uses its defaults
    assert models == OPEN_WEBUI_FALLBACK_MODELS and voices == OPEN_WEBUI_FALLBACK_VOICES
    payload = {"input": "zqwebuikeyed Hello.", "voice": "nova", "model": "tts-1"}
    status, body = asyncio.run(open_webui_speech(base, API_KEY, payload))
    assert status == 200 and decode(body, "mp3")[0].size > 0
    assert len(standin_backend.requests_tagged("zqwebuikeyed")) == 1
    status, body = asyncio.run(open_webui_speech(base, "wrong", payload))
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def home_assistant_voices(speech_url: str, api_key: str) -> list[dict[str, str]]:
    """The integration's voice picker: GET the sibling of the speech URL, read id/name pairs."""
    voices_url = speech_url.rsplit("/", 1)[0] + "/voices"

    async def fetch() -> object:
        headers = {"User-Agent": "HomeAssistant-OpenAI-TTS", "Authorization": f"Bearer {api_key}"}
        async with aiohttp.ClientSession() as session:
            async with session.get(voices_url, headers=headers, params={"limit": 100}) as response:
                assert response.status == 200
                return await response.json(content_type=None)

    payload = asyncio.run(fetch())
    assert isinstance(payload, dict)
    items = payload.get("items") or payload.get("data") or payload.get("voices") or []
    return [{"value": v["id"], "label": v["name"]} for v in items]


def test_home_assistant_lists_voices_and_speaks_mp3_and_streams_opus(keyed_gateway, standin_backend):
    speech_url = f"{keyed_gateway.base_url}/v1/audio/speech"
    options = home_assistant_voices(speech_url, API_KEY)
    assert sorted(o["label"] for o in options) == ["amy", "ben", "clara", "dave"]
    voice = next(o["value"] for o in options if o["label"] == "dave")
    headers = {"Content-Type": "application/json", "User-Agent": "HomeAssistant-OpenAI-TTS",
               "Authorization": f"Bearer {API_KEY}"}
    payload = {"model": "gpt-4o-mini-tts", "input": "zqhomeassistant The lights are off.", "voice": voice,
               "response_format": "mp3", "speed": 1.0, "instructions": "Calm and quiet."}
    request = urllib.request.Request(speech_url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200 and response.headers["Content-Type"] == "audio/mpeg"
        assert decode(response.read(), "mp3")[0].size > 0
    [record] = standin_backend.requests_tagged("zqhomeassistant")
    assert record["voice_id"] == voice and record["instruction_text"] == "Calm and quiet."

    async def stream_opus() -> list[bytes]:
        body = {**payload, "input": "zqhastream Streaming now.", "response_format": "opus"}
        del body["instructions"]
        async with aiohttp.ClientSession() as session:
            async with session.post(speech_url, json=body, headers=headers) as response:
                assert response.status == 200 and response.headers["Content-Type"] == "audio/opus"
                return [chunk async for chunk in response.content.iter_chunked(4096)]

    chunks = asyncio.run(stream_opus())
    audio = b"".join(chunks)
    assert audio[:4] == b"OggS" and decode(audio, "opus")[0].size > 0
    [streamed] = standin_backend.requests_tagged("zqhastream")
    assert streamed["instruction_text"] is None


def test_litellm_proxy_call_shape(gateway, standin_backend):
    """LiteLLM maps `openai/tts-1` to model "tts-1" on `api_base` and calls the SDK with the caller's params."""
    litellm_model = "openai/tts-1"
    client = gateway.client()  # api_base = <gateway>/v1, as configured in LiteLLM's model_list
    response = client.audio.speech.create(
        model=litellm_model.split("/", 1)[1], voice="alloy", input="zqlitellm Routed through the proxy."
    )
    assert decode(response.content, "mp3")[0].size > 0
    [record] = standin_backend.requests_tagged("zqlitellm")
    assert record["model"] == "cosyvoice2_stream"
    response = client.audio.speech.create(
        model="tts-1-hd", voice="shimmer", input="zqlitellmwav Hi.", response_format="wav", speed=0.9
    )
    assert response.content[:4] == b"RIFF" and len(standin_backend.requests_tagged("zqlitellmwav")) == 1
