"""Start-up failures that a restart cannot fix stop the gateway and the local stack at once, with a message that
says what to change; only a process that dies after it was serving is restarted (tests/reliability/
test_stack_faults.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from triton_repo import local_stack
from triton_repo.local_stack import GATEWAY_CANNOT_START, StackError, Supervisor, default_stack_dir
from triton_repo.server import REPO_ROOT

#: Far below a tritonserver start: a launcher that gets as far as loading models has not failed fast.
FAIL_FAST_S = 90


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _run(module: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("COSYVOICE_", "TTS_"))}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=FAIL_FAST_S,
        env={**inherited, "PYTHONPATH": str(REPO_ROOT), **env},
    )  # fmt: skip
    return done, time.monotonic() - started


def test_the_gateway_on_a_busy_port_exits_at_once_naming_tts_port(busy_port):
    done, _ = _run("gateway", TTS_PORT=str(busy_port))
    assert done.returncode == GATEWAY_CANNOT_START
    assert f"port {busy_port} on 127.0.0.1 is already in use" in done.stderr and "TTS_PORT" in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_gateway_settings_name_each_variable():
    done, _ = _run("gateway", "--check", TTS_PORT="99999", TTS_MAX_IN_FLIGHT="0")
    assert done.returncode == GATEWAY_CANNOT_START
    assert "TTS_PORT" in done.stderr and "TTS_MAX_IN_FLIGHT" in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("startup_model"))


@pytest.mark.parametrize("setting", ["busy port", "bad setting"])
def test_the_stack_stops_at_once_when_the_gateway_cannot_start(tiny_model, tmp_path, busy_port, setting):
    """`make demo` / `make run` with the gateway's port taken: one message naming TTS_PORT, exit 2, before
    tritonserver is started (no restart loop, no repository rendered)."""
    env = {"TTS_PORT": str(busy_port)} if setting == "busy port" else {"TTS_MAX_IN_FLIGHT": "0"}
    done, seconds = _run(
        "triton_repo.local_stack", "--model-dir", str(tiny_model), "--repo-dir", str(tmp_path / "repo"), **env
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert ("TTS_PORT" if setting == "busy port" else "TTS_MAX_IN_FLIGHT") in done.stderr
    assert "restarting" not in output and "tritonserver" not in done.stdout
    assert not (tmp_path / "repo").exists() and seconds < FAIL_FAST_S


class _Served:
    """The supervisor's view of a tritonserver that is up (nothing to start or stop here)."""

    grpc_url = "127.0.0.1:1"


def _supervised_gateway(exit_status: int) -> tuple[Supervisor, list[str]]:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    supervisor = Supervisor(_Served(), environment, threading.Event())  # type: ignore[arg-type]
    starts: list[str] = []
    supervisor._start_gateway = lambda: starts.append("start")  # type: ignore[method-assign]
    supervisor.gateway = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({exit_status})"])
    supervisor.gateway.wait()
    supervisor._gateway_backoff.initial_s = 0.0
    return supervisor, starts


def test_a_gateway_that_cannot_start_is_not_restarted():
    supervisor, starts = _supervised_gateway(GATEWAY_CANNOT_START)
    with pytest.raises(StackError, match="could not start"):
        supervisor._check_gateway()
    assert starts == []


def test_a_gateway_that_died_while_serving_is_restarted():
    supervisor, starts = _supervised_gateway(1)
    supervisor._check_gateway()
    assert starts == ["start"]


class _Rendered(Exception):
    """Stops the launcher where it renders: the test needs to know where, not a running stack."""


def test_each_stack_renders_into_its_own_directory(tiny_model, monkeypatch):
    """Two stacks from one checkout (a demo beside `make run`) never share a repository or a log: the default
    directory is named after the gateway's port, which two running stacks cannot share."""
    rendered: list[Path] = []

    def render(options):
        rendered.append(options.out)
        raise _Rendered

    monkeypatch.setattr(local_stack, "write_repository", render)
    for key in [k for k in os.environ if k.startswith(("TTS_", "COSYVOICE_"))]:
        monkeypatch.delenv(key)
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    for port in ports:
        monkeypatch.setenv("TTS_PORT", str(port))
        with pytest.raises(_Rendered):
            local_stack.main(["--model-dir", str(tiny_model)])
    assert rendered == [default_stack_dir(port) / "triton_repo" for port in ports]
    assert rendered[0].parent != rendered[1].parent and rendered[0].parent.parent == REPO_ROOT / "var"
