"""The local stack (`python -m triton_repo.local_stack`) on the tiny model as a subprocess on loopback, plus what
the reliability suites need to observe and hurt it: its processes (from /proc), their memory, its metrics."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from triton_repo.server import PORT_CONFLICT_MARK, REPO_ROOT, free_ports, process_tree

#: Starts on fresh ports after a port conflict before giving up.
PORT_CONFLICT_ATTEMPTS = 3

#: Loading the tiny pipeline on a busy 2-core machine takes tens of seconds.
START_TIMEOUT_S = 300.0
#: The tiny model's random weights never stop by themselves (every request would generate 20 speech tokens per
#: text token); benchmark mode makes it exactly this many, so suites measure the serving path, not the CPU.
SPEECH_RATIO = ("--benchmark-speech-ratio", "2")


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    return sorted(process_tree(pid) - {pid})


def http_status(url: str, timeout: float = 3.0) -> int:
    """The status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def process_tree_rss(pid: int | None) -> tuple[int, int]:
    """(resident bytes, processes) of ``pid`` and all its descendants; (0, 0) when it is gone."""
    if pid is None or not rss_bytes(pid):
        return 0, 0
    tree = [pid, *descendants(pid)]
    return sum(rss_bytes(p) for p in tree), len(tree)


def gateway_metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the gateway's /metrics at ``url`` (0 when the series is absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def triton_active_requests(metrics_port: int) -> float:
    """Requests the pipeline entry models hold now (the orchestrator's gauge, both models)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    gauges = re.findall(r"^cosyvoice2_orchestrator_active_requests\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in gauges)


#: The stack's ports, chosen together.
PORTS = ("gateway_port", "http_port", "grpc_port", "metrics_port")


@dataclass
class StackProcess:
    """``python -m triton_repo.local_stack`` with pinned ports; stopped (TERM, then KILL of its group) by ``stop``."""

    model_dir: Path
    work_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    gateway_port: int = 0  # 0: chosen at construction, the four distinct (`free_ports`)
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self._choose_ports(*(name for name in PORTS if not getattr(self, name)))

    def _choose_ports(self, *names: str) -> None:
        for name, port in zip(names, free_ports(len(names))):
            setattr(self, name, port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "stack.log"

    def start(self) -> StackProcess:
        """Start and wait for the gateway's /ready. Its ports were free when chosen, but another process may
        bind one before the stack does (the gateway would then be restarted on it forever): a start that fails
        with a port conflict in its log is retried on newly chosen ports."""
        for attempt in range(1, PORT_CONFLICT_ATTEMPTS + 1):
            log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._launch()
            if self.wait_ready(START_TIMEOUT_S, give_up_on_port_conflict_since=log_start) is not None:
                return self
            conflict = PORT_CONFLICT_MARK in self._log_since(log_start)
            log = self.log_tail()
            self.stop()
            if not conflict or attempt == PORT_CONFLICT_ATTEMPTS:
                raise RuntimeError(f"the stack did not become ready; log tail:\n{log}")
            self._choose_ports(*PORTS)
        raise AssertionError("unreachable")

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def _launch(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "TTS_PORT": str(self.gateway_port),
            "TTS_UPLOADED_VOICES_DIR": str(self.work_dir / "voices"),
            "COSYVOICE_TRITON_HTTP_PORT": str(self.http_port),
            "COSYVOICE_TRITON_GRPC_PORT": str(self.grpc_port),
            "COSYVOICE_TRITON_METRICS_PORT": str(self.metrics_port),
            **self.extra_env,
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - our own module
                [sys.executable, "-m", "triton_repo.local_stack", "--model-dir", str(self.model_dir),
                 "--repo-dir", str(self.work_dir / "repo"), *self.extra_args],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self, timeout: float, give_up_on_port_conflict_since: int | None = None) -> float | None:
        """Seconds until the gateway's /ready said 200 (None: it did not within ``timeout``, or the stack
        exited, or, with ``give_up_on_port_conflict_since``, its log reported a port conflict after that offset)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                return None
            if http_status(f"{self.url}/ready") == 200:
                return time.monotonic() - started
            if give_up_on_port_conflict_since is not None and self.log_path.exists():
                if PORT_CONFLICT_MARK in self._log_since(give_up_on_port_conflict_since):
                    return None
            time.sleep(0.2)
        return None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    # processes ---------------------------------------------------------------------------------------
    def tritonserver_pid(self) -> int | None:
        flag = f"--grpc-port={self.grpc_port}"
        for pid in descendants(self.proc.pid) if self.proc else []:
            cmd = _cmdline(pid)
            if cmd and cmd[0].endswith("tritonserver") and flag in cmd:
                return pid
        return None

    def stub_pid(self, model: str) -> int | None:
        """The python-backend stub process serving ``model``."""
        triton = self.tritonserver_pid()
        for pid in descendants(triton) if triton else []:
            cmd = _cmdline(pid)
            if len(cmd) > 1 and cmd[0].endswith("triton_python_backend_stub") and f"/{model}/1/model.py" in cmd[1]:
                return pid
        return None

    def gateway_pid(self) -> int | None:
        for pid in descendants(self.proc.pid) if self.proc else []:
            if _cmdline(pid)[1:3] == ["-m", "gateway"]:
                return pid
        return None

    def triton_rss(self) -> int:
        """tritonserver and all its stubs."""
        return process_tree_rss(self.tritonserver_pid())[0]

    def gateway_rss(self) -> int:
        pid = self.gateway_pid()
        return rss_bytes(pid) if pid else 0

    def gateway_metric(self, name: str, labels: str = "") -> float:
        return gateway_metric(self.url, name, labels)

    def triton_active_requests(self) -> float:
        return triton_active_requests(self.metrics_port)

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (drain), wait, then KILL whatever is left of the group. The stack's exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait(10)
