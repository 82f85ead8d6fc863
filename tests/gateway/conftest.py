"""Gateway test rig: the stand-in pipeline in a real tritonserver in front of the shared gateway rig
(real uvicorn gateways, the real OpenAI SDK as client; tests/conftest.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# The gateway rig (IsolatedSettings, RunningGateway, the gateway_factory fixture) lives in tests/conftest.py:
# tests/triton runs it in front of the real pipeline. Re-exported for the tests that import it from here.
from tests.conftest import IsolatedSettings, RunningGateway  # noqa: F401
from tests.gateway.standin_model.repository import render_standin_repository
from tests.gateway.standin_model.standin import read_request_log
from triton_repo.server import TritonServer


#: The stand-in's chunk schedule in the shared server: enough chunks to see streaming happen.
CHUNK_COUNT = 4
CHUNK_DELAY_MS = 30


@dataclass
class StandinBackend:
    """A running tritonserver with the stand-in models and the directory of its observations."""

    server: TritonServer
    marker_dir: Path

    def requests(self) -> list[dict]:
        return read_request_log(self.marker_dir)

    def requests_tagged(self, tag: str) -> list[dict]:
        return [r for r in self.requests() if r["tag"] == tag]

    def release(self, tag: str) -> None:
        (self.marker_dir / f"{tag}.release").touch()

    def marker(self, tag: str, what: str) -> Path:
        return self.marker_dir / f"{tag}.{what}"


def start_standin_backend(factory: Callable[..., TritonServer], root: Path, **ports: int) -> StandinBackend:
    marker_dir = root / "markers"
    repository = render_standin_repository(
        root / "models", marker_dir, chunk_count=CHUNK_COUNT, chunk_delay_ms=CHUNK_DELAY_MS
    )
    return StandinBackend(server=factory(repository, **ports), marker_dir=marker_dir)


@pytest.fixture(scope="session")
def standin_backend(triton_server_factory, tmp_path_factory) -> StandinBackend:
    return start_standin_backend(triton_server_factory, tmp_path_factory.mktemp("standin"))


@pytest.fixture(scope="session")
def gateway(standin_backend, gateway_factory) -> RunningGateway:
    """The shared gateway: default settings, in front of the shared stand-in backend."""
    return gateway_factory(standin_backend.server.grpc_url)


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def async_wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()
