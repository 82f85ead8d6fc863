"""The gateway as a deployment of LiteLLM's real router (`litellm.Router`, what its proxy runs per request).

LiteLLM's router "cools down" a deployment after an error it reads as the deployment's fault (404, 401, 408,
429, 5xx) and then refuses every caller's request for that model ("No deployments available") until the
cooldown ends; a 400 is the caller's fault and leaves the deployment in service. So a request that is wrong
(an unknown voice, a bad format) must be a 400, or one client's typo takes the model down for everyone.
"""

from __future__ import annotations

import asyncio
import importlib
import os

import pytest
import yaml

from tests.gateway.audio_checks import decode
from triton_repo.server import REPO_ROOT

pytestmark = pytest.mark.triton

#: Our gateway as LiteLLM's proxy config names it: `openai/<model id>` on `api_base` (docs/clients.md).
MODEL_NAME = "speech"


@pytest.fixture(scope="module")
def litellm():
    # LiteLLM fetches a price list from the internet on import unless told to use its bundled copy.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return importlib.import_module("litellm")


def router_for(litellm, base_url: str, model: str = "openai/tts-1"):
    return litellm.Router(
        model_list=[
            {
                "model_name": MODEL_NAME,
                "litellm_params": {"model": model, "api_base": f"{base_url}/v1", "api_key": "unused"},
            }
        ],
        num_retries=0,
    )


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"voice": "nobody"}, "Voice 'nobody' not found"),
        ({"voice": "alloy", "response_format": "ogg"}, "response_format"),
        ({"voice": "alloy", "speed": 9.0}, "speed"),
        ({"voice": "alloy", "input": "?!"}, "nothing to speak"),
    ],
)
def test_a_bad_request_does_not_take_the_deployment_out_of_the_router(litellm, gateway, bad, said):
    router = router_for(litellm, gateway.base_url)

    async def bad_then_good() -> bytes:
        request = {"model": MODEL_NAME, "input": "zqrouterbad Hi.", **bad}
        with pytest.raises(litellm.BadRequestError) as caught:
            await router.aspeech(**request)
        assert caught.value.status_code == 400 and said in str(caught.value)
        # the next caller, with a valid request, is served by the same (only) deployment
        response = await router.aspeech(model=MODEL_NAME, input="zqrouterok Still served.", voice="alloy")
        return response.content

    audio = asyncio.run(bad_then_good())
    assert decode(audio, "mp3")[0].size > 0


def test_a_404_does_take_the_deployment_out(litellm, gateway):
    """The control: a deployment configured with a model id the gateway does not serve gets 404 model_not_found
    (a deployment's fault, as OpenAI answers it), and LiteLLM's router refuses the next request without asking
    it. A bad request answered with 404 would do the same to every caller."""
    router = router_for(litellm, gateway.base_url, model="openai/tts-none")

    async def twice() -> tuple[BaseException, BaseException]:
        with pytest.raises(litellm.NotFoundError) as first:
            await router.aspeech(model=MODEL_NAME, input="Hi.", voice="alloy")
        with pytest.raises(Exception) as second:
            await router.aspeech(model=MODEL_NAME, input="Hi.", voice="alloy")
        return first.value, second.value

    first, second = asyncio.run(twice())
    assert "The model 'tts-none' does not exist" in str(first)
    assert "No deployments available" in str(second)


def _documented_config() -> dict:
    """The LiteLLM proxy config of docs/clients.md (its first YAML block under "LiteLLM proxy")."""
    text = (REPO_ROOT / "docs" / "clients.md").read_text(encoding="utf-8")
    section = text.split("## LiteLLM proxy", 1)[1]
    return yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])


def test_the_documented_proxy_config_starts_and_routes_to_the_gateway(litellm, gateway, monkeypatch):
    config = _documented_config()
    # the proxy refuses to start without a master key
    assert str(config["general_settings"]["master_key"]).startswith("os.environ/")
    [deployment] = config["model_list"]
    params = deployment["litellm_params"]
    assert params["model"].split("/", 1)[1] in gateway.settings.served_models
    monkeypatch.setenv(params["api_key"].split("/", 1)[1], "unused")
    routed = {**deployment, "litellm_params": {**params, "api_base": f"{gateway.base_url}/v1"}}
    router = litellm.Router(model_list=[routed], num_retries=0)
    speech = asyncio.run(router.aspeech(model=deployment["model_name"], voice="alloy", input="Routed through LiteLLM."))
    assert decode(speech.content, "mp3")[0].size > 0


def test_what_reaches_the_gateway_through_the_router(litellm, gateway, standin_backend):
    """What docs/clients.md says of LiteLLM: OpenAI's parameters reach the gateway, SSE and the extensions do not
    (not even in extra_body)."""
    router = router_for(litellm, gateway.base_url)

    async def call(**options) -> bytes:
        return (await router.aspeech(model=MODEL_NAME, voice="alloy", **options)).content

    openai_params = asyncio.run(call(input="zqrouterparams Hi.", instructions="calm", response_format="wav"))
    assert openai_params[:4] == b"RIFF"
    [record] = standin_backend.requests_tagged("zqrouterparams")
    assert record["instruction_text"] == "calm"
    for tag, options in (("zqroutersse", {"stream_format": "sse", "seed": 7}),
                         ("zqrouterextra", {"extra_body": {"stream_format": "sse", "seed": 9}})):
        audio = asyncio.run(call(input=f"{tag} Hi.", **options))
        assert not audio.startswith(b"data:") and decode(audio, "mp3")[0].size > 0  # the audio file, not SSE
        [record] = standin_backend.requests_tagged(tag)
        assert record["seed"] is None
