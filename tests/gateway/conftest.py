"""Gateway test rig: the stand-in pipeline in a real tritonserver, real uvicorn gateways, the
real OpenAI SDK as client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.standin_model.repository import render_standin_repository
from triton_repo.server import TritonServer, free_port


#: The stand-in's chunk schedule in the shared server: enough chunks to see streaming happen.
CHUNK_COUNT = 4
CHUNK_DELAY_MS = 30


@dataclass
class StandinBackend:
    """A running tritonserver with the stand-in models and the directory of its observations."""

    server: TritonServer
    marker_dir: Path

    def requests(self) -> list[dict]:
        log = self.marker_dir / "requests.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

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


class IsolatedSettings(Settings):
    """Settings from the test's arguments only: a developer's TTS_* variables or .env must not leak in."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **other_sources):  # type: ignore[override]
        return (init_settings,)


class RunningGateway:
    """A real uvicorn server with ``create_app(settings)`` in a background thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self) -> RunningGateway:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def client(self, api_key: str = "unused", **options: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **options)

    def async_client(self, api_key: str = "unused", **options: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **options)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample of the gateway's /metrics (0 when absent)."""
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in httpx.get(f"{self.base_url}/metrics").text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="session")
def gateway_factory(tmp_path_factory) -> Iterator[Callable[..., RunningGateway]]:
    """``start(triton_url, **settings) -> RunningGateway`` on a free port; stopped at session end.
    Each gateway gets an empty uploaded-voices directory unless one is given."""
    running: list[RunningGateway] = []

    def start(triton_url: str, **overrides: object) -> RunningGateway:
        overrides.setdefault("uploaded_voices_dir", tmp_path_factory.mktemp("uploaded_voices"))
        settings = IsolatedSettings(triton_url=triton_url, port=free_port(), log_level="warning", **overrides)
        gateway = RunningGateway(settings).start()
        running.append(gateway)
        return gateway

    yield start
    for gateway in running:
        gateway.stop()


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
