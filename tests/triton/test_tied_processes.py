"""A tritonserver (and a stack's gateway) never outlives the process that started it: a test run or a benchmark
killed by a timeout left its servers running on a GPU machine, holding GPU memory under the next measurement."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from triton_repo.server import REPO_ROOT, spawn_tied

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaps, as under a container's init that does not reap, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


def start_parent(code: str) -> tuple[subprocess.Popen, int]:
    """A Python process running `code`, which prints the pid of the child it starts; returns it and that pid."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the parent printed {line!r}"
    return parent, int(line)


def kill_parent(parent: subprocess.Popen) -> None:
    parent.send_signal(signal.SIGKILL)  # nothing of the parent's own runs: no finally, no atexit
    parent.wait(10)


@pytest.mark.triton
def test_a_tritonserver_stops_when_the_process_that_started_it_is_killed(tmp_path):
    parent, pid = start_parent(f"""
        import time
        from triton_repo.server import TritonServer
        server = TritonServer(model_repository={str(tmp_path)!r}).start(ready_timeout=120)  # empty: ready at once
        print(server._proc.pid, flush=True)
        time.sleep(600)
    """)
    try:
        assert alive(pid)
        kill_parent(parent)
        assert wait_gone(pid, 40), "tritonserver outlived the process that started it"
    finally:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_a_child_started_from_a_short_lived_thread_lives_on_until_the_process_dies():
    """The kernel signals the child when the thread that forked it exits; the local stack starts tritonserver from a
    thread that ends once the server is up."""
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(spawn_tied(["sleep", "60"], start_new_session=True)))
    thread.start()
    thread.join()
    child = started[0]
    try:
        time.sleep(0.5)
        assert child.poll() is None, "the child died with the thread that started it"
    finally:
        child.kill()
        child.wait(5)


def test_a_child_of_a_killed_process_gets_sigterm():
    parent, pid = start_parent("""
        import subprocess, time
        from triton_repo.server import spawn_tied
        child = spawn_tied(["sleep", "600"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        kill_parent(parent)
        assert wait_gone(pid, 10)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_without_the_tie_the_same_child_outlives_its_parent():
    """The test above can fail: a plain Popen's child in a session of its own survives its parent's death."""
    parent, pid = start_parent("""
        import subprocess, time
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        kill_parent(parent)
        assert not wait_gone(pid, 2)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
