"""A free port can be taken by another process between choosing it and tritonserver binding it: a start on
chosen ports retries on new ones, a start on pinned ports reports the conflict."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from triton_repo import server as server_module
from triton_repo.server import TritonLaunchError, TritonServer

pytestmark = pytest.mark.triton


@pytest.fixture
def taken_port():
    """A port another process holds (listening), as when a free port is grabbed before tritonserver binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_chosen_ports_are_chosen_again_after_a_conflict(tmp_path, taken_port, monkeypatch):
    real_free_port = server_module.free_port
    handed_out: list[int] = []

    def free_port_taken_first() -> int:
        port = taken_port if not handed_out else real_free_port()
        handed_out.append(port)
        return port

    monkeypatch.setattr(server_module, "free_port", free_port_taken_first)
    server = TritonServer(model_repository=tmp_path)  # an empty repository: ready at once
    try:
        server.start(ready_timeout=120)
        assert handed_out[0] == taken_port and taken_port not in (server.http_port, server.grpc_port)
        assert server.is_ready()
        # ready means every endpoint answers, the metrics too (tritonserver opens that port last)
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            assert response.status == 200
        assert "already in use" in server.log_path.read_text()  # the first attempt did meet the conflict
    finally:
        server.cleanup()


def test_pinned_ports_are_never_changed(tmp_path, taken_port):
    server = TritonServer(model_repository=tmp_path, grpc_port=taken_port)
    try:
        with pytest.raises(TritonLaunchError, match="already in use"):
            server.start(ready_timeout=120)
        assert server.grpc_port == taken_port
    finally:
        server.cleanup()
