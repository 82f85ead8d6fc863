"""The local stack (`make run`): render the repository with the PyTorch LLM (the default, colocated
layout: LLM and token2wav in one `engine` process), start the bundled tritonserver and the gateway in
front of it, and keep both running.

    python -m triton_repo.stack [--model-dir models/CosyVoice2-0.5B] [--device cpu|cuda] [--port 8080]
                                [--token2wav unet|dit --dit-dir models/Step-Audio-2-mini/token2wav]
                                [--spark-dir models/Spark-TTS-0.5B]
                                [--triton-http-port P] [--triton-grpc-port P] [--triton-metrics-port P]

Supervision: if tritonserver exits, loses a model process (a python-backend stub), or stays unready
for `UNHEALTHY_RESTART_S`, it is restarted on the same ports with exponential back-off; the gateway
keeps running meanwhile (503 + `Retry-After`, `/ready` 503) and reconnects by itself. If the gateway
exits it is restarted the same way. Ctrl-C
(SIGINT) or SIGTERM drains: the gateway finishes the requests in flight (`TTS_DRAIN_GRACE_S`) and
exits, then tritonserver is stopped; a second signal stops at once.

Settings come from the command line or the environment: `COSYVOICE_MODEL_DIR` (the model directory),
`COSYVOICE_DEVICE`, `COSYVOICE_DTYPE`, `COSYVOICE_TOKEN2WAV` / `COSYVOICE_DIT_DIR` (which token2wav, render's
`--token2wav` / `--dit-dir`), `COSYVOICE_SPARK_DIR` (a Spark-TTS model directory: Spark-TTS is served beside
CosyVoice2 as `model="spark-tts"`, render's `--spark-dir`), `COSYVOICE_TRITON_HTTP_PORT` / `_GRPC_PORT` / `_METRICS_PORT`
(0 or unset: free ports, chosen once and kept across restarts), and the gateway's own `TTS_*`
variables (its port, voices, ...). When the model directory is missing or empty the build tooling's
`download` stage fetches it, if that tooling is installed; otherwise the launcher says what to put where.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from triton_repo.render import MODEL_FILES, TOKEN2WAVS, RenderError, RenderOptions, write_repository
from triton_repo.server import REPO_ROOT, TritonLaunchError, TritonServer, free_port
from triton_repo.spark_render import SparkRenderOptions

DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "CosyVoice2-0.5B"
DEFAULT_REPO_DIR = REPO_ROOT / "var" / "triton_repo"


class StackError(RuntimeError):
    pass


def ensure_model_dir(model_dir: Path) -> None:
    """Download the weights into an empty/missing `model_dir` through the build tooling, if present."""
    if model_dir.is_dir() and any(model_dir.iterdir()):
        return
    if importlib.util.find_spec("cosyvoice_build") is None:
        raise StackError(
            f"no model in {model_dir}. Put the official CosyVoice2-0.5B files there "
            f"({', '.join(MODEL_FILES)}; e.g. `huggingface-cli download FunAudioLLM/CosyVoice2-0.5B "
            f"--local-dir {model_dir}`) or set COSYVOICE_MODEL_DIR / --model-dir to where they are."
        )
    if model_dir.name != "CosyVoice2-0.5B":
        raise StackError(
            f"{model_dir} is empty and the download stage writes <work dir>/CosyVoice2-0.5B: "
            "point --model-dir at such a directory or fill this one with the official files"
        )
    print(f"[stack] {model_dir} is empty: downloading the weights (cosyvoice_build download stage)", flush=True)
    command = [
        sys.executable,
        "-m",
        "cosyvoice_build",
        "--work-dir",
        str(model_dir.parent),
        "--from",
        "download",
        "--to",
        "download",
    ]
    if subprocess.run(command, check=False).returncode != 0:  # noqa: S603 - our own module
        raise StackError(f"downloading the weights failed ({' '.join(command)}); see its output above")


@dataclass
class Backoff:
    """Restart delays: doubling from `initial` to `maximum`; back to `initial` after a run of `reset_after_s`."""

    initial_s: float = 1.0
    maximum_s: float = 30.0
    reset_after_s: float = 60.0
    _next_s: float = field(default=0.0, init=False)

    def delay(self, uptime_s: float) -> float:
        if uptime_s >= self.reset_after_s or self._next_s == 0.0:
            self._next_s = self.initial_s
        delay, self._next_s = self._next_s, min(self._next_s * 2, self.maximum_s)
        return delay


@dataclass(frozen=True)
class TritonPorts:
    http: int = 0
    grpc: int = 0
    metrics: int = 0


#: tritonserver alive but not ready this long (a wedged model) is restarted like a crashed one.
UNHEALTHY_RESTART_S = 60.0
#: Upper bound of a drain: the gateway has its own grace period (TTS_DRAIN_GRACE_S); this only keeps
#: a wedged gateway from blocking the stop forever.
GATEWAY_STOP_TIMEOUT_S = 600.0
POLL_S = 0.5


def _child_pids(pid: int | None) -> set[int]:
    """Live child processes of `pid` (Linux /proc; zombies count as dead)."""
    children: set[int] = set()
    if pid is None:
        return children
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            children.add(int(entry))
    return children


def _log(message: str) -> None:
    print(f"[stack] {message}", flush=True)


class Supervisor:
    """Keeps tritonserver and the gateway running until a signal, then drains and stops both."""

    def __init__(self, server: TritonServer, gateway_env: dict[str, str], stop: threading.Event) -> None:
        self.server = server
        self.gateway_env = gateway_env
        self.stop = stop
        self.signals = 0
        self.gateway: subprocess.Popen | None = None
        self._triton_backoff, self._gateway_backoff = Backoff(), Backoff()
        self._triton_since = self._gateway_since = time.monotonic()
        self._unready_since: float | None = None
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._stubs: set[int] = set()  # the model (stub) processes of the running tritonserver

    # Triton ---------------------------------------------------------------------------------------
    def _start_triton(self, ready_timeout: float) -> None:
        """Start tritonserver in a thread, so that a signal is handled while models load."""

        def start() -> None:
            try:
                self.server.start(ready_timeout=ready_timeout)
            except BaseException as exc:  # noqa: BLE001 - reported by the loop
                self._start_error = exc

        self._start_error = None
        self._starting = threading.Thread(target=start, name="tritonserver-start", daemon=True)
        self._starting.start()
        self._triton_since = time.monotonic()

    def _wait_started(self) -> bool:
        """Wait for a start to finish; False if a signal came first or the start failed."""
        assert self._starting is not None
        while self._starting.is_alive():
            if self.stop.wait(POLL_S):
                self.server.stop()  # its readiness wait then fails and the thread ends
                self._starting.join()
                return False
        self._starting = None
        return self._start_error is None

    def _restart_triton(self, reason: str) -> None:
        delay = self._triton_backoff.delay(time.monotonic() - self._triton_since)
        _log(f"tritonserver {reason}; restarting in {delay:.0f} s. Log tail:\n{self.server.log_tail(20)}")
        self.server.stop()
        self._unready_since = None
        if not self.stop.wait(delay):
            self._start_triton(ready_timeout=900)

    def _check_triton(self) -> None:
        if self._starting is not None:
            if self._starting.is_alive():
                return
            self._starting = None
            if self._start_error is not None:
                self._restart_triton(f"failed to start ({self._start_error})")
            else:
                self._stubs = _child_pids(self.server.pid)
                _log(f"tritonserver ready again after {time.monotonic() - self._triton_since:.1f} s")
            return
        if self.server.exited:
            self._restart_triton("exited")
            return
        # A dead python-backend stub is not brought back by tritonserver when only other models call it
        # (BLS): the server stays "ready" while every request fails. Restart the whole server instead.
        dead = self._stubs - _child_pids(self.server.pid)
        if dead:
            self._restart_triton(f"lost {len(dead)} model process(es) ({', '.join(map(str, sorted(dead)))})")
            return
        if self.server.is_ready():
            self._unready_since = None
        elif self._unready_since is None:
            self._unready_since = time.monotonic()
        elif time.monotonic() - self._unready_since > UNHEALTHY_RESTART_S:
            self._restart_triton(f"not ready for {UNHEALTHY_RESTART_S:.0f} s")

    # Gateway --------------------------------------------------------------------------------------
    def _start_gateway(self) -> None:
        # its own process group: Ctrl-C reaches us once, and we drain the gateway ourselves
        self.gateway = subprocess.Popen(  # noqa: S603 - our own module
            [sys.executable, "-m", "gateway"], env=self.gateway_env, start_new_session=True
        )
        self._gateway_since = time.monotonic()
        _log(f"gateway started (pid {self.gateway.pid})")

    def _check_gateway(self) -> None:
        assert self.gateway is not None
        if self.gateway.poll() is None:
            return
        delay = self._gateway_backoff.delay(time.monotonic() - self._gateway_since)
        _log(f"the gateway exited with {self.gateway.returncode}; restarting in {delay:.0f} s")
        if not self.stop.wait(delay):
            self._start_gateway()

    # Lifecycle ------------------------------------------------------------------------------------
    def run(self) -> int:
        self._start_triton(ready_timeout=900)
        if not self._wait_started():
            if self._start_error is not None and not self.stop.is_set():
                raise self._start_error
            return 0  # stopped by a signal while the models loaded
        _log(
            f"tritonserver ready: grpc {self.server.grpc_url}, http {self.server.http_url}, "
            f"metrics :{self.server.metrics_port}, log {self.server.log_path}"
        )
        self._stubs = _child_pids(self.server.pid)
        self._start_gateway()
        _log("Ctrl-C or SIGTERM drains and stops everything")
        while not self.stop.wait(POLL_S):
            self._check_triton()
            if not self.stop.is_set():
                self._check_gateway()
        return 0

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        self.stop.set()
        if self.signals > 1 and self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(sig)  # the gateway's second signal: exit now

    def shutdown(self) -> None:
        _log("stopping: draining the gateway")
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(GATEWAY_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait()
        _log("gateway stopped; stopping tritonserver")
        self.server.cleanup()


def run_stack(
    model_dir: Path,
    repo_dir: Path,
    device: str,
    dtype: str,
    gateway_port: int | None,
    ports: TritonPorts,
    benchmark_speech_ratio: float | None = None,
    token2wav: str = "unet",
    dit_dir: Path | None = None,
    spark_dir: Path | None = None,
) -> int:
    ensure_model_dir(model_dir)
    options = RenderOptions(
        model_dir=model_dir, out=repo_dir, device=device, dtype=dtype, benchmark_speech_ratio=benchmark_speech_ratio,
        token2wav=token2wav, dit_dir=dit_dir, spark=SparkRenderOptions(spark_dir) if spark_dir is not None else None,
    )
    repo = write_repository(options)
    _log(f"rendered {repo}; starting tritonserver (loading models takes a while)")
    server = TritonServer(
        model_repository=repo,
        log_path=repo_dir.parent / "tritonserver.log",
        http_port=ports.http,
        grpc_port=ports.grpc,
        metrics_port=ports.metrics,
    )
    for attr in ("http_port", "grpc_port", "metrics_port"):  # chosen once: a restart keeps them
        if not getattr(server, attr):
            setattr(server, attr, free_port())
    env = {**os.environ, "TTS_TRITON_URL": server.grpc_url}
    if gateway_port is not None:
        env["TTS_PORT"] = str(gateway_port)
    supervisor = Supervisor(server, env, threading.Event())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: supervisor.on_signal(number))
    try:
        return supervisor.run()
    finally:
        supervisor.shutdown()


def _env_port(name: str) -> int:
    value = os.environ.get(name, "0").strip() or "0"
    if not value.isdigit() or int(value) > 65535:
        raise StackError(f"{name} must be a port number (0 = a free one), not {value!r}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_repo.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, default=Path(os.environ.get("COSYVOICE_MODEL_DIR", DEFAULT_MODEL_DIR))
    )
    parser.add_argument("--repo-dir", type=Path, default=DEFAULT_REPO_DIR, help="where the repository is rendered")
    parser.add_argument("--device", default=os.environ.get("COSYVOICE_DEVICE", "cpu"), choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=os.environ.get("COSYVOICE_DTYPE", "fp32"), choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--port", type=int, default=None, help="gateway port (default: TTS_PORT or 8080)")
    parser.add_argument("--token2wav", default=os.environ.get("COSYVOICE_TOKEN2WAV", "unet"), choices=TOKEN2WAVS,
                        help="unet: CosyVoice2's flow; dit: the DiT flow of Step-Audio-2-mini (needs --dit-dir)")
    parser.add_argument("--dit-dir", type=Path, default=os.environ.get("COSYVOICE_DIT_DIR") or None,
                        help="the released token2wav/ directory (default: COSYVOICE_DIT_DIR)")
    parser.add_argument("--spark-dir", type=Path, default=os.environ.get("COSYVOICE_SPARK_DIR") or None,
                        help="a Spark-TTS model directory to serve beside CosyVoice2 (default: COSYVOICE_SPARK_DIR)")
    for kind in ("http", "grpc", "metrics"):
        parser.add_argument(
            f"--triton-{kind}-port", type=int, default=None,
            help=f"tritonserver {kind} port (default: COSYVOICE_TRITON_{kind.upper()}_PORT, else a free one)",
        )  # fmt: skip
    parser.add_argument(
        "--benchmark-speech-ratio", type=float, default=None,
        help="benchmark mode: every request generates exactly this many speech tokens per text token",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        ports = TritonPorts(
            *(
                getattr(args, f"triton_{kind}_port")
                if getattr(args, f"triton_{kind}_port") is not None
                else _env_port(f"COSYVOICE_TRITON_{kind.upper()}_PORT")
                for kind in ("http", "grpc", "metrics")
            )
        )
        return run_stack(
            args.model_dir.resolve(), args.repo_dir.resolve(), args.device, args.dtype, args.port, ports,
            args.benchmark_speech_ratio, args.token2wav,
            Path(args.dit_dir).resolve() if args.dit_dir else None,
            Path(args.spark_dir).resolve() if args.spark_dir else None,
        )  # fmt: skip
    except (StackError, RenderError, TritonLaunchError) as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
