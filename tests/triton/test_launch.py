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


# -- the stubs' Python environment ------------------------------------------------------------------------------
def _env_with_numpy(root: Path, version: str | None) -> Path:
    site = root / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "python3").touch()
    if version is not None:
        (site / f"numpy-{version}.dist-info").mkdir()
    return root


def test_the_numpy_of_a_stub_environment_is_read_from_its_site_packages(tmp_path):
    from triton_repo.server import numpy_major

    assert numpy_major(_env_with_numpy(tmp_path / "one", "1.26.4")) == 1
    assert numpy_major(_env_with_numpy(tmp_path / "two", "2.1.3")) == 2
    assert numpy_major(_env_with_numpy(tmp_path / "none", None)) is None
    import numpy

    assert numpy_major(Path(sys.prefix)) == int(numpy.__version__.split(".")[0])


def test_a_server_whose_stubs_would_run_with_numpy_2_refuses_to_start(tmp_path):
    from triton_repo.server import TritonLaunchError, TritonServer, check_stub_env

    check_stub_env(_env_with_numpy(tmp_path / "one", "1.26.4"))  # fine
    check_stub_env(_env_with_numpy(tmp_path / "none", None))  # nothing to tell: the stub's own import says
    numpy2 = _env_with_numpy(tmp_path / "two", "2.1.3")
    server = TritonServer(model_repository=tmp_path / "repo", env_prefix=numpy2)
    with pytest.raises(TritonLaunchError, match=r"has numpy 2\.x, and the python-backend stub needs numpy < 2: run "
                                                r"scripts/gpu_setup\.sh"):
        server.start(ready_timeout=5)
    assert server.pid is None  # refused before any process started


def test_the_stubs_run_in_the_separate_stub_environment_where_this_one_has_numpy_2(tmp_path, monkeypatch):
    import triton_repo.server as server

    stub_env = _env_with_numpy(tmp_path / "stub", "1.26.4")
    monkeypatch.setattr(server, "DEFAULT_STUB_ENV", stub_env)
    here = Path(sys.prefix)
    assert server.default_stub_env() == (stub_env if (server.numpy_major(here) or 0) >= 2 else here)
    monkeypatch.setattr(server, "numpy_major", lambda env: 2 if Path(env) == here else 1)
    assert server.default_stub_env() == stub_env
    monkeypatch.setattr(server, "DEFAULT_STUB_ENV", tmp_path / "absent")
    assert server.default_stub_env() == here  # nothing better: its start then says what to do


def test_the_stubs_library_path_puts_libpython_ahead_and_nothing_else_of_its_directory(tmp_path, monkeypatch):
    """Python's LIBDIR may be a system directory full of CUDA libraries (the GPU images': /usr/lib/x86_64-linux-gnu,
    with cuDNN): on LD_LIBRARY_PATH they would win over torch's own. Only a link to libpython goes there."""
    import triton_repo.server as server

    system = tmp_path / "usr-lib"
    system.mkdir()
    for name in ("libpython3.99.so.1.0", "libcudnn_engines_precompiled.so.9", "libcublas.so.13"):
        (system / name).write_bytes(b"")
    config = {"LIBDIR": str(system), "INSTSONAME": "libpython3.99.so.1.0"}
    monkeypatch.setattr(server.sysconfig, "get_config_var", lambda key: config.get(key))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/inherited")
    ts = server.TritonServer(model_repository=tmp_path / "repo", env_prefix=Path(sys.prefix))
    ts._workdir = tmp_path / "work"  # what a start makes first
    paths = ts._env(tmp_path / "pytriton" / "tritonserver")["LD_LIBRARY_PATH"].split(":")
    assert str(system) not in paths
    assert paths[-1] == "/opt/inherited"  # what the caller had comes last, as before
    linked = [Path(p) for p in paths if (Path(p) / "libpython3.99.so.1.0").exists()]
    assert len(linked) == 1 and [c.name for c in linked[0].iterdir()] == ["libpython3.99.so.1.0"]
    assert (linked[0] / "libpython3.99.so.1.0").resolve() == system / "libpython3.99.so.1.0"
    config["INSTSONAME"] = "libpython3.99.a"  # a static build: nothing to link
    (system / "libpython3.99.a").write_bytes(b"")
    assert server.libpython_dir(tmp_path / "again") is None
    config["INSTSONAME"] = None
    assert server.libpython_dir(tmp_path / "again") is None
