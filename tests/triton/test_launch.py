"""The containers' tritonserver launcher (`triton_repo.launch`).

No GPU here: `tritonserver` is a stand-in script on PATH that records how it was started and exits with the status
it is given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_repo.launch import tritonserver_command
from triton_repo.server import SERVING_ARGS

FAKE_SERVER = """#!/bin/sh
# stand-in for tritonserver: records how it was started, then exits with $FAKE_EXIT
{
  echo "pid=$$"
  echo "args=$*"
} > "$RECORD_DIR/server.txt"
exit "$FAKE_EXIT"
"""


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has the stand-in tritonserver first; its record lands in RECORD_DIR."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    path = bin_dir / "tritonserver"
    path.write_text(FAKE_SERVER)
    path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TRITONSERVER"}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", RECORD_DIR=str(record))
    return env


def launch(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "triton_repo.launch", "--model-repository=/models/repo", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def record(env: dict[str, str], name: str) -> str:
    path = Path(env["RECORD_DIR"]) / name
    return path.read_text() if path.exists() else ""


def test_every_serving_argument_is_added_and_a_given_one_wins():
    command = tritonserver_command(["--model-repository=/m", "--exit-timeout-secs=5"], {})
    assert command[0] == "tritonserver" and command[1:3] == ["--model-repository=/m", "--exit-timeout-secs=5"]
    assert [a for a in command if a.startswith("--exit-timeout-secs")] == ["--exit-timeout-secs=5"]
    others = [a for a in SERVING_ARGS if not a.startswith("--exit-timeout-secs")]
    assert others and all(a in command for a in others)
    assert tritonserver_command([], {"TRITONSERVER": "/opt/ts"})[0] == "/opt/ts"


def test_a_backend_config_replaces_only_the_same_setting():
    """`--backend-config` is given once per backend setting: another setting keeps the serving default, the same
    setting given explicitly replaces it."""
    default = next(a for a in SERVING_ARGS if a.startswith("--backend-config=python,thread-pool-size="))
    other = tritonserver_command(["--backend-config=python,shm-default-byte-size=4194304"], {})
    assert default in other and "--backend-config=python,shm-default-byte-size=4194304" in other
    mine = tritonserver_command(["--backend-config=python,thread-pool-size=8"], {})
    assert [a for a in mine if "thread-pool-size" in a] == ["--backend-config=python,thread-pool-size=8"]


@pytest.mark.parametrize("status", [0, 3])
def test_tritonserver_replaces_the_launcher_and_its_status_is_the_launchers(fakes, status):
    proc = launch(dict(fakes, FAKE_EXIT=str(status)))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == status, out
    server = record(fakes, "server.txt")
    assert f"pid={proc.pid}" in server  # exec: the same process, nothing left in between
    assert "--model-repository=/models/repo" in server and all(a in server for a in SERVING_ARGS)
