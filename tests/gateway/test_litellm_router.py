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

from tests.gateway.audio_checks import decode

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
