"""tritonserver's readiness deadline follows what the machine is doing: past its deadline a start that still
uses CPU (loading on a busy machine) gets more time, up to a cap; one that stalls fails (no test runs a fixed
deadline out on a loaded CI machine, none waits for a hung server forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triton_repo import server as server_module
from triton_repo.server import TritonLaunchError, TritonServer, free_ports, process_tree_cpu_seconds

BUSY = "while True: pass"
IDLE = "import time; time.sleep(600)"


def _never_ready(tmp_path: Path, code: str) -> TritonServer:
    """A TritonServer whose process is `code` (a child that never answers on the ports) instead of tritonserver."""
    http_port, metrics_port = free_ports(2)
    server = TritonServer(model_repository=tmp_path, http_port=http_port, metrics_port=metrics_port)
    # a child of a child, as the model processes are tritonserver's: the whole tree's CPU counts
    server._proc = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"],
        start_new_session=True,
    )
    return server


def _end(server: TritonServer) -> None:
    """The child and its child (a session of their own: one signal ends both)."""
    os.killpg(server._proc.pid, signal.SIGKILL)
    server._proc.wait()


@pytest.fixture
def quick_stall(monkeypatch):
    monkeypatch.setattr(server_module, "READY_STALL_S", 2.0)


def _wait(server: TritonServer, timeout: float) -> tuple[str, float]:
    started = time.monotonic()
    try:
        with pytest.raises(TritonLaunchError) as caught:
            server.wait_ready(timeout)
    finally:
        _end(server)
    return str(caught.value), time.monotonic() - started


def test_a_start_that_keeps_working_gets_more_time_up_to_the_cap(tmp_path, quick_stall):
    message, waited = _wait(_never_ready(tmp_path, BUSY), timeout=2.0)
    assert "still loading" in message
    assert waited >= 2.0 * server_module.READY_STRETCH - 0.5  # not cut at the plain deadline


def test_a_stalled_start_fails_soon_after_its_deadline(tmp_path, quick_stall):
    message, waited = _wait(_never_ready(tmp_path, IDLE), timeout=2.0)
    assert "no CPU used" in message and waited < 2.0 * server_module.READY_STRETCH


def test_the_cpu_of_the_whole_process_tree_counts(tmp_path):
    server = _never_ready(tmp_path, BUSY)
    try:
        first = process_tree_cpu_seconds(server._proc.pid)
        time.sleep(1.5)
        assert process_tree_cpu_seconds(server._proc.pid) > first + 0.1  # the grandchild's spinning
    finally:
        _end(server)
