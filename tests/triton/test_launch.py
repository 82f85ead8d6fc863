"""The containers' tritonserver launcher (`triton_repo.launch`) and its CUDA MPS daemon (`triton_repo.cuda_mps`).

No GPU here: `nvidia-cuda-mps-control` and `tritonserver` are stand-in scripts on PATH that do what the launcher
relies on (the daemon opens its control socket in the pipe directory and removes it on `quit`; the server records
its arguments, environment and signals). The real daemon is exercised on the GPU machines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triton_repo.cuda_mps import CONTROL_SOCKET, PIPE_DIR_ENV, SETTING_ENV, MpsDaemon, MpsError, mps_setting
from triton_repo.launch import BAD_SETTINGS, tritonserver_command
from triton_repo.server import SERVING_ARGS

FAKE_CONTROL = """#!/bin/sh
# stand-in for nvidia-cuda-mps-control: -d starts (opens the control socket), "quit" on stdin stops
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$RECORD_DIR/control.calls"
if [ "$1" = "-d" ]; then
  [ -n "$CUDA_MPS_PIPE_DIRECTORY" ] || exit 1
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read command
[ "$command" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""

FAKE_SERVER = """#!/bin/sh
# stand-in for tritonserver: records how it was started, waits for SIGTERM (or exits with $FAKE_EXIT)
{
  echo "pid=$$"
  echo "args=$*"
  echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"
  if [ -n "$CUDA_MPS_PIPE_DIRECTORY" ] && [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then echo daemon=up; fi
} > "$RECORD_DIR/server.txt"
if [ -n "$FAKE_EXIT" ]; then exit "$FAKE_EXIT"; fi
trap 'echo term >> "$RECORD_DIR/server.txt"; exit 0' TERM
touch "$RECORD_DIR/server.ready"
while true; do sleep 0.05; done
"""


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has the stand-in binaries first; records land in RECORD_DIR."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, text in (("nvidia-cuda-mps-control", FAKE_CONTROL), ("tritonserver", FAKE_SERVER)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (SETTING_ENV, PIPE_DIR_ENV, "TRITONSERVER")}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", RECORD_DIR=str(record))
    return env


def launch(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "triton_repo.launch", "--model-repository=/models/repo", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def record(env: dict[str, str], name: str) -> str:
    path = Path(env["RECORD_DIR"]) / name
    return path.read_text() if path.exists() else ""


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_every_serving_argument_is_added_and_a_given_one_wins():
    command = tritonserver_command(["--model-repository=/m", "--exit-timeout-secs=5"], {})
    assert command[0] == "tritonserver" and command[1:3] == ["--model-repository=/m", "--exit-timeout-secs=5"]
    assert [a for a in command if a.startswith("--exit-timeout-secs")] == ["--exit-timeout-secs=5"]
    others = [a for a in SERVING_ARGS if not a.startswith("--exit-timeout-secs")]
    assert others and all(a in command for a in others)
    assert tritonserver_command([], {"TRITONSERVER": "/opt/ts"})[0] == "/opt/ts"


def test_without_mps_tritonserver_replaces_the_launcher(fakes):
    proc = launch(dict(fakes, FAKE_EXIT="0"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    server = record(fakes, "server.txt")
    assert f"pid={proc.pid}" in server  # exec: the same process, nothing left in between
    assert "pipe=\n" in server and not record(fakes, "control.calls")
    assert "--model-repository=/models/repo" in server and all(a in server for a in SERVING_ARGS)


def test_with_mps_the_daemon_runs_around_tritonserver_and_its_status_is_returned(fakes):
    proc = launch(dict(fakes, FAKE_EXIT="3", **{SETTING_ENV: "on"}))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    server = record(fakes, "server.txt")
    assert "daemon=up" in server and f"pid={proc.pid}" not in server
    pipe = server.split("pipe=")[1].split("\n")[0]
    calls = record(fakes, "control.calls").splitlines()
    assert calls == [f"-d pipe={pipe}", f" pipe={pipe}"]  # started, then told to quit
    assert not (Path(pipe) / CONTROL_SOCKET).exists()
    assert "CUDA MPS: control daemon started" in out and "CUDA MPS: control daemon stopped" in out


def test_with_mps_sigterm_reaches_tritonserver_and_the_daemon_stops_after_it(fakes):
    proc = launch(dict(fakes, **{SETTING_ENV: "on"}))
    wait_for(Path(fakes["RECORD_DIR"]) / "server.ready")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert record(fakes, "server.txt").rstrip().endswith("term")
    assert len(record(fakes, "control.calls").splitlines()) == 2


@pytest.mark.parametrize("setting, path_has_control", [("on", False), ("maybe", True)])
def test_a_setting_that_cannot_work_stops_the_launch_with_a_message_naming_it(fakes, setting, path_has_control):
    env = dict(fakes, **{SETTING_ENV: setting})
    if not path_has_control:
        (Path(fakes["PATH"].split(":")[0]) / "nvidia-cuda-mps-control").unlink()
    proc = launch(env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == BAD_SETTINGS and SETTING_ENV in out and not record(fakes, "server.txt")


def test_a_daemon_already_serving_the_pipe_directory_is_used_and_left_running(fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fakes["PATH"])
    monkeypatch.setenv("RECORD_DIR", fakes["RECORD_DIR"])
    pipe = tmp_path / "mps"
    with MpsDaemon(pipe_dir=pipe) as ours:
        assert ours.started and ours.env()[PIPE_DIR_ENV] == str(pipe)
        with MpsDaemon(pipe_dir=pipe) as second:
            assert not second.started
        assert (pipe / CONTROL_SOCKET).exists()  # the second left the first one's daemon alone
    assert not (pipe / CONTROL_SOCKET).exists()
    assert len(record(fakes, "control.calls").splitlines()) == 2


def test_a_pipe_directory_too_long_for_a_socket_is_refused(fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fakes["PATH"])
    with pytest.raises(MpsError, match="too long"):
        MpsDaemon(pipe_dir=tmp_path / ("x" * 120)).start()


@pytest.mark.parametrize("value, expected", [(None, False), ("", False), ("off", False), ("ON", True), ("1", True)])
def test_the_setting_reads_on_and_off(value, expected):
    assert mps_setting(value) is expected
