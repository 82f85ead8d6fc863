"""Shared test fixtures: a real tritonserver on free ports for any model repository."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from triton_repo.server import TritonServer

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Shared reference data lives next to the checkout: <repo root>/../shared.
SHARED_DIR = REPO_ROOT.parent / "shared"

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
        server.cleanup()
