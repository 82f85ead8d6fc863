"""Schema fuzzing (schemathesis over the gateway's own OpenAPI schema) against a real gateway in front of the
stand-in model, on loopback: whatever the inputs, no 5xx and every error in the OpenAI shape.
Bounded for CI by MAX_EXAMPLES per operation; raise it for a longer run (`FUZZ_MAX_EXAMPLES=500 pytest ...`)."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.gateway.conftest import standin_backend  # noqa: F401 - the stand-in as a fixture here

pytestmark = pytest.mark.triton

MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "40"))
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzzed_gateway(standin_backend, gateway_factory):  # noqa: F811
    # In-flight limit high enough that fuzzing never meets 429 by accident; a small body limit is fuzzed too.
    return gateway_factory(standin_backend.server.grpc_url, max_in_flight=64, max_request_bytes=64 * 1024)


@pytest.fixture(scope="module")
def api_schema(fuzzed_gateway):
    return schemathesis.openapi.from_url(f"{fuzzed_gateway.base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_gateway_fail(case):
    response = case.call(timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith("application/json"):
        assert set(response.json()["error"]) == ERROR_KEYS
