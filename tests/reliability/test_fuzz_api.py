"""Schema fuzzing: schemathesis generates requests (valid and invalid) from the gateway's own OpenAPI schema
and sends them to a real gateway in front of the stand-in model, on loopback. Whatever the input: no 5xx,
every JSON error in the OpenAI shape. Bounded for CI by MAX_EXAMPLES per operation; a longer run:
`FUZZ_MAX_EXAMPLES=1000 pytest tests/reliability/test_fuzz_api.py`."""

from __future__ import annotations

import os

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

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
