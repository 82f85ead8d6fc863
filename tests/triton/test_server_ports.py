"""A free port can be taken by another process between choosing it and tritonserver binding it: a start on
chosen ports retries on new ones, a start on pinned ports reports the conflict."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

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
    real_free_ports = server_module.free_ports
    handed_out: list[int] = []

    def free_ports_taken_first(count: int) -> list[int]:
        ports = real_free_ports(count)
        if not handed_out:
            ports[0] = taken_port
        handed_out.extend(ports)
        return ports

    monkeypatch.setattr(server_module, "free_ports", free_ports_taken_first)
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


def test_ports_chosen_together_are_distinct_where_the_kernel_hands_a_closed_port_out_again(monkeypatch):
    """A port is free again once the socket that found it closes; choosing a server's ports one at a time gave the
    same port twice (tritonserver then refuses to start: HTTP and metrics on one port). Every start chooses its
    ports at once."""

    class ReusingSocket:  # the kernel's choice for port 0: the lowest port no open socket holds
        held: set[int] = set()

        def __init__(self, *args) -> None:
            self.port = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            ReusingSocket.held.discard(self.port)

        def bind(self, address) -> None:
            self.port = min(set(range(40000, 40010)) - ReusingSocket.held)
            ReusingSocket.held.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(server_module.socket, "socket", ReusingSocket)
    assert len(set(server_module.free_ports(3))) == 3
    started: list[tuple[int, int, int]] = []
    monkeypatch.setattr(TritonServer, "_start_once",
                        lambda self, timeout: started.append((self.http_port, self.grpc_port, self.metrics_port)))
    TritonServer(model_repository=Path("unused")).start()
    assert len(set(started[0])) == 3, started
