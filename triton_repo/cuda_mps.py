"""A CUDA MPS control daemon owned by one serving stack.

Why: the pipeline's GPU work runs in several processes (tritonserver's python-backend model processes: the LLM,
token2wav, in the `single` and `disaggregated` layouts each its own process). Without MPS the GPU time-slices
between processes, so one process's kernels never run beside another's; under the Multi-Process Service their
kernels share the GPU at once, as two streams of one process do, and the processes keep their own GILs.

The daemon is started before any CUDA client of the stack (`nvidia-cuda-mps-control -d`) and told to quit after
the last one has exited. Its clients find it through `CUDA_MPS_PIPE_DIRECTORY`; each stack gets its own pipe
directory, so two stacks on one machine never share (or stop) each other's daemon. A pipe directory already
served by a running daemon is used as it is and left running.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

#: The daemon's control program (NVIDIA driver utilities).
CONTROL_BINARY = "nvidia-cuda-mps-control"
#: Where the daemon's clients look for it, and where it logs (CUDA's variables).
PIPE_DIR_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIR_ENV = "CUDA_MPS_LOG_DIRECTORY"
#: The operators' switch (`make run`, compose, Kubernetes): on / off.
SETTING_ENV = "COSYVOICE_CUDA_MPS"
#: The daemon's control socket inside the pipe directory; it exists while a daemon serves that directory.
CONTROL_SOCKET = "control"
#: A Unix socket path is limited to 107 bytes: pipe directories live under a short temporary path.
MAX_SOCKET_PATH = 107

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 30.0


class MpsError(RuntimeError):
    """The daemon could not be started: the message says what to change."""


def mps_setting(value: str | None) -> bool:
    """`COSYVOICE_CUDA_MPS`'s value as a switch (unset or empty: off)."""
    text = (value or "").strip().lower()
    if text in ("", "0", "off", "false", "no"):
        return False
    if text in ("1", "on", "true", "yes"):
        return True
    raise MpsError(f"{SETTING_ENV}={value!r}: use on or off")


@dataclass
class MpsDaemon:
    """One control daemon: `start()`, then give `env()` to every CUDA process of the stack, then `stop()`."""

    pipe_dir: Path | None = None  # default: a new private directory under the system's temporary directory
    log_dir: Path | None = None  # default: `pipe_dir`/log
    binary: str = CONTROL_BINARY
    started: bool = field(default=False, init=False)  # this object started the daemon (and so stops it)

    def env(self) -> dict[str, str]:
        """The variables a CUDA process needs to run as a client of this daemon."""
        assert self.pipe_dir is not None and self.log_dir is not None, "start() first"
        return {PIPE_DIR_ENV: str(self.pipe_dir), LOG_DIR_ENV: str(self.log_dir)}

    @property
    def running(self) -> bool:
        return self.pipe_dir is not None and (self.pipe_dir / CONTROL_SOCKET).exists()

    def start(self) -> MpsDaemon:
        control = shutil.which(self.binary)
        if control is None:
            raise MpsError(f"{SETTING_ENV}=on needs {self.binary} (NVIDIA's driver utilities) on PATH: install "
                           f"them, or set {SETTING_ENV}=off")
        if self.pipe_dir is None:
            self.pipe_dir = Path(tempfile.mkdtemp(prefix="cosyvoice-mps-"))
        if len(str(self.pipe_dir / CONTROL_SOCKET)) > MAX_SOCKET_PATH:
            raise MpsError(f"CUDA MPS pipe directory {self.pipe_dir} is too long for a Unix socket: choose a path "
                           f"of at most {MAX_SOCKET_PATH - len(CONTROL_SOCKET) - 1} characters")
        self.log_dir = self.log_dir or self.pipe_dir / "log"
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.running:
            logger.info("CUDA MPS: a control daemon already serves %s; using it", self.pipe_dir)
            return self
        result = self._control(control, ["-d"])
        if result.returncode != 0:
            raise MpsError(f"CUDA MPS: `{self.binary} -d` failed (exit {result.returncode}): "
                           f"{result.stdout.strip() or 'no output'}; see {self.log_dir}/control.log, or set "
                           f"{SETTING_ENV}=off")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.running:
            if time.monotonic() > deadline:
                raise MpsError(f"CUDA MPS: the control daemon did not open {self.pipe_dir / CONTROL_SOCKET} "
                               f"within {START_TIMEOUT_S:.0f} s; see {self.log_dir}/control.log")
            time.sleep(0.05)
        self.started = True
        logger.info("CUDA MPS: control daemon started (pipe directory %s, log %s); the stack's GPU processes "
                    "share each GPU through it", self.pipe_dir, self.log_dir)
        return self

    def stop(self) -> None:
        """Quit the daemon this object started (after its clients have exited); idempotent."""
        if not self.started:
            return
        self.started = False
        control = shutil.which(self.binary)
        if control is not None and self.running:
            result = self._control(control, [], stdin="quit\n")
            if result.returncode != 0:
                logger.warning("CUDA MPS: quit failed (exit %s): %s", result.returncode, result.stdout.strip())
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.running and time.monotonic() < deadline:
                time.sleep(0.05)
        logger.info("CUDA MPS: control daemon stopped (pipe directory %s)", self.pipe_dir)

    def _control(self, control: str, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, **self.env())
        return subprocess.run(  # noqa: S603 - NVIDIA's control program, our arguments
            [control, *args], env=env, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=STOP_TIMEOUT_S, check=False,
        )

    def __enter__(self) -> MpsDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
