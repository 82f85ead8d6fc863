"""Shared test fixtures: a real tritonserver on free ports for any model repository, and real gateways
(uvicorn + the OpenAI SDK as client) in front of any tritonserver (tests/gateway and tests/triton)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gateway.settings import Settings
from triton_repo.server import TritonServer

if TYPE_CHECKING:
    import httpx
    import openai

# The gateway's own dependencies (uvicorn, the OpenAI SDK, httpx, audio encoders) are imported where a gateway
# starts: a GPU machine runs tests/gpu with the engine and tritonserver installed, without them.

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The parity oracles: micro models (seeded random weights, released file layout) with the upstream
#: implementation's outputs for fixed inputs; each directory's README lists its arrays and tolerances.
FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"

TritonFactory = Callable[..., TritonServer]


@pytest.fixture(scope="session")
def triton_server_factory() -> Iterator[TritonFactory]:
    """``start(model_repository, **TritonServer options) -> TritonServer`` (ready).

    Each server gets its own free ports and shm prefix, so several may run side by side and in
    parallel CI jobs; all of them are stopped (TERM, then KILL of the process group) at session end.
    Tests using it should be marked ``triton``.
    """
    started: list[TritonServer] = []

    def start(model_repository: Path, *, ready_timeout: float = 120.0, **options: object) -> TritonServer:
        server = TritonServer(model_repository=Path(model_repository), **options)  # type: ignore[arg-type]
        started.append(server)
        return server.start(ready_timeout=ready_timeout)

    yield start
    for server in started:
        if server.exited:  # it ended on its own (a crash, a signal): its log says how, before cleanup removes it
            sys.__stderr__.write(f"\ntritonserver of {server.model_repository} ended on its own; the end of its log:\n"
                                 f"{server.log_tail(60)}\n")
        server.cleanup()


class IsolatedSettings(Settings):
    """Settings from the test's arguments only: a developer's TTS_* variables or .env must not leak in."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **other_sources):  # type: ignore[override]
        return (init_settings,)


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to a free port. Serving on it (instead of on a port number chosen earlier) leaves no
    moment in which another process of a busy CI machine could take the port first."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


class RunningGateway:
    """A real uvicorn server with ``create_app(settings)`` in a background thread, serving on ``sock`` (bound
    to ``settings.port``) when given."""

    def __init__(self, settings: Settings, sock: socket.socket | None = None) -> None:
        import uvicorn

        from gateway.app import create_app

        self.settings = settings
        self.app = create_app(settings)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on")
        )
        self._sock = sock
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock] if sock else None}, name="gateway", daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self) -> RunningGateway:
        self._thread.start()
        deadline = time.monotonic() + 120  # start-up decodes every shipped voice: slow on a loaded machine
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        if self._sock is not None:
            self._sock.close()

    def client(self, api_key: str = "unused", **options: object) -> openai.OpenAI:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **options)

    def async_client(self, api_key: str = "unused", **options: object) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **options)

    def http(self) -> httpx.Client:
        import httpx

        return httpx.Client(base_url=self.base_url, timeout=30)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample of the gateway's /metrics (0 when absent)."""
        import httpx

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
        sock = bound_socket()
        settings = IsolatedSettings(triton_url=triton_url, port=sock.getsockname()[1], log_level="warning", **overrides)
        gateway = RunningGateway(settings, sock).start()
        running.append(gateway)
        return gateway

    yield start
    for gateway in running:
        gateway.stop()
