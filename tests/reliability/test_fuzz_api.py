"""Schema fuzzing: schemathesis generates requests (valid and invalid) from the gateway's own OpenAPI schema
and sends them to a real gateway in front of the stand-in model, on loopback. Whatever the input: no 5xx,
every JSON error in the OpenAI shape. Bounded for CI by MAX_EXAMPLES per operation; a longer run:
`FUZZ_MAX_EXAMPLES=1000 pytest tests/reliability/test_fuzz_api.py`."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from speech_text.segment import is_speakable
from gateway.app import create_app
from tests.conftest import IsolatedSettings
from tests.gateway.conftest import standin_backend  # noqa: F401 - the stand-in as a fixture here

pytestmark = pytest.mark.triton

MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "50"))
ERROR_KEYS = {"message", "type", "param", "code"}

#: The schema is static: the app's own, without starting it.
SCHEMA = schemathesis.openapi.from_dict(create_app(IsolatedSettings()).openapi())
OPERATIONS = {operation.label: operation for operation in (result.ok() for result in SCHEMA.get_all_operations())}


@pytest.fixture(scope="module")
def fuzzed_gateway(standin_backend, gateway_factory):  # noqa: F811
    # In-flight limit high enough that fuzzing never meets 429 by accident; a small body limit is fuzzed too.
    return gateway_factory(standin_backend.server.grpc_url, max_in_flight=64, max_request_bytes=64 * 1024)


@pytest.fixture(scope="module")
def fuzz_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    yield counts
    print(f"\nfuzz cases per status: {dict(sorted(counts.items()))}, total {sum(counts.values())}")


#: Valid inputs (by the schema) everywhere; invalid ones (types, bounds, required fields broken) where a body
#: can be broken (path-only operations have no invalid form).
CASES = [(label, GenerationMode.POSITIVE) for label in sorted(OPERATIONS)] + [
    (label, GenerationMode.NEGATIVE) for label in sorted(OPERATIONS) if label.startswith("POST ")
]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label} {mode.value}" for label, mode in CASES])
def test_no_input_makes_the_gateway_fail(fuzzed_gateway, fuzz_counts, label, mode):
    operation = OPERATIONS[label]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        response = case.call(base_url=fuzzed_gateway.base_url, timeout=60)
        fuzz_counts[str(response.status_code)] = fuzz_counts.get(str(response.status_code), 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        content_type = response.headers.get("content-type") or [""]  # schemathesis: header -> list of values
        if response.status_code >= 400 and content_type[0].startswith("application/json"):
            assert set(response.json()["error"]) == ERROR_KEYS

    fuzz()


SPEECH_BODIES = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tts-1", "gpt-4o-mini-tts"]),
        "voice": st.sampled_from(["alloy", "amy", "Ben", {"id": "voice_nope"}]),
        "input": st.text(min_size=1, max_size=600),
    },
    optional={
        "response_format": st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm"]),
        "speed": st.floats(min_value=0.25, max_value=4.0),
        "stream_format": st.sampled_from(["audio", "sse"]),
        "stream": st.booleans(),
        "seed": st.integers(min_value=0, max_value=2**64 - 1),
        "instructions": st.text(max_size=50),
    },
)


def test_any_text_in_a_valid_request_is_spoken_or_refused_cleanly(fuzzed_gateway, fuzz_counts):
    """Valid requests with arbitrary Unicode text (the schema fuzzer rarely gets past model and voice):
    the whole path runs (segmenter, pipeline, encoders); the answer is audio, or a 4xx for text with nothing
    to speak, never a server error."""

    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=SPEECH_BODIES)
    def fuzz(body) -> None:
        with httpx.Client(base_url=fuzzed_gateway.base_url, timeout=120) as http:
            response = http.post("/v1/audio/speech", json=body)
        fuzz_counts[f"speech {response.status_code}"] = fuzz_counts.get(f"speech {response.status_code}", 0) + 1
        assert response.status_code in (200, 400), response.text[:300]
        if response.status_code == 200:
            assert len(response.content) > 0
        else:
            error = response.json()["error"]
            assert set(error) == ERROR_KEYS
            if error["param"] == "voice":  # an unknown voice is the request's fault: 400, like OpenAI's
                assert body["voice"] == {"id": "voice_nope"} and error["code"] == "voice_not_found"
            else:
                assert error["param"] == "input" and not is_speakable(body["input"])

    fuzz()
