"""The local stack (`make run`): render the repository with the PyTorch LLM (the default, colocated
layout: LLM and token2wav in one `engine` process), start the bundled tritonserver and the gateway in
front of it, and keep both running.

    python -m triton_repo.local_stack [--model-dir models/CosyVoice2-0.5B] [--device cpu|cuda] [--port 8080]
                                [--token2wav unet|dit --dit-dir models/Step-Audio-2-mini/token2wav]
                                [--spark-dir models/Spark-TTS-0.5B] [--cosyvoice3-dir models/Fun-CosyVoice3-0.5B-2512]
                                [--triton-http-port P] [--triton-grpc-port P] [--triton-metrics-port P]
    python -m triton_repo.local_stack --demo [--demo-dir ~/.cache/cosyvoice-serve/demo-model] [--port 8080]

Start-up: what a restart cannot fix stops the launcher at once (exit status 2) with a message that says what
to change: the gateway's settings and port are checked first (`python -m gateway --check`: a port in use names
`TTS_PORT`), then the model directory, the rendering and tritonserver's first start (a pinned tritonserver port in
use names its `COSYVOICE_TRITON_*_PORT`); a gateway that cannot start (its exit status `GATEWAY_CANNOT_START`)
is not restarted either.

Supervision: once serving, if tritonserver exits, loses a model process (a python-backend stub), or stays unready
for `UNHEALTHY_RESTART_S`, it is restarted on the same ports with exponential back-off; the gateway
keeps running meanwhile (503 + `Retry-After`, `/ready` 503) and reconnects by itself. If the gateway
exits after it was serving it is restarted the same way. Ctrl-C
(SIGINT) or SIGTERM drains: the gateway finishes the requests in flight (`TTS_DRAIN_GRACE_S`) and
exits, then tritonserver is stopped; a second signal stops at once.

Settings come from the command line or the environment: `COSYVOICE_MODEL_DIR` (the model directory),
`COSYVOICE_DEVICE`, `COSYVOICE_DTYPE`, `COSYVOICE_TOKEN2WAV` / `COSYVOICE_DIT_DIR` (which token2wav, render's
`--token2wav` / `--dit-dir`), `COSYVOICE_SPARK_DIR` (a Spark-TTS model directory: Spark-TTS is served beside
CosyVoice2 as `model="spark-tts"`, render's `--spark-dir`), `COSYVOICE_COSYVOICE3_DIR` (a CosyVoice3 model directory:
CosyVoice3 is served beside CosyVoice2 as `model="cosyvoice3"`, render's `--cosyvoice3-dir`),
`COSYVOICE_TRITON_HTTP_PORT` / `_GRPC_PORT` / `_METRICS_PORT`
(0 or unset: free ports, chosen once and kept across restarts), and the gateway's own `TTS_*`
variables (its port, voices, ...). When the model directory lacks a file the engine reads, the launcher
stops before creating anything and says what to do: the command that downloads the weights (`make weights`,
about 3 GB), the variable that points elsewhere, or the demo.

Files: each stack renders into its own `var/stack-<gateway port>/triton_repo` (`--repo-dir` elsewhere) and
tritonserver logs to `tritonserver.log` beside it.

`--demo` (`make demo`) needs no weights: it writes a tiny random-weight model into `--demo-dir`
(`COSYVOICE_DEMO_DIR`, default `$XDG_CACHE_HOME/cosyvoice-serve/demo-model`) once, and a tiny random CosyVoice3
into its `cosyvoice3/` (served beside it as `model="cosyvoice3"`), runs both in benchmark
mode (random weights never stop by themselves) and starts the gateway with `TTS_DEMO=true`, which labels
every response and prints the base URL with example calls. Its audio is noise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from cosyvoice2.layout import REQUIRED_FILES, model_dir_problems
from cosyvoice3.layout import released_dir_problems
from triton_repo.render import TOKEN2WAVS, CosyVoice3RenderOptions, RenderError, RenderOptions, write_repository
from triton_repo.server import CLEAN_STOP_S, REPO_ROOT, TritonLaunchError, TritonServer, spawn_tied, stop_process
from triton_repo.spark_render import SparkRenderOptions

DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "CosyVoice2-0.5B"
#: Each stack started from this checkout writes into its own directory here, named after its gateway's port (no two
#: stacks share one): the rendered repository (`triton_repo/`) and `tritonserver.log`. A demo beside `make run`,
#: or a second checkout's test run, no longer overwrites another stack's repository or mixes its log.
STACKS_DIR = REPO_ROOT / "var"


def default_stack_dir(gateway_port: int) -> Path:
    """`var/stack-<gateway port>`; a gateway on a free port (0) has no port yet: the launcher's pid then."""
    return STACKS_DIR / (f"stack-{gateway_port}" if gateway_port else f"stack-pid{os.getpid()}")


class StackError(RuntimeError):
    pass


def _default_demo_dir() -> Path:
    """``$XDG_CACHE_HOME/cosyvoice-serve/demo-model``: regenerable, so it lives in the cache, not the checkout."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "cosyvoice-serve" / "demo-model"


#: The build tool's download stage writes `<work dir>/<this name>`.
WEIGHTS_DIRNAME = DEFAULT_MODEL_DIR.name
#: Speech tokens per text token in the demo: random weights never stop by themselves, benchmark mode makes every
#: request this long; with the byte-level demo tokenizer it is about the pace of real speech (25 tokens/s).
DEMO_SPEECH_RATIO = 2.0
DEMO_SEED = 0
#: Written last into a demo model directory: marks it as ours (so it may be rewritten) and says what it is.
DEMO_MARKER = "RANDOM_WEIGHTS.txt"
#: The demo's CosyVoice3 (served beside its CosyVoice2 as `model="cosyvoice3"`) lives in this subdirectory of the
#: demo directory: one cache directory holds the whole demo.
DEMO_COSYVOICE3_SUBDIR = "cosyvoice3"


def _shown_python() -> str:
    """This interpreter as a user would type it (relative inside the checkout: `.venv/bin/python`)."""
    python = Path(sys.executable)
    try:
        return str(python.relative_to(Path.cwd()))
    except ValueError:
        return str(python)


def check_model_dir(model_dir: Path) -> None:
    """Refuse a model directory that lacks a file the engine reads, saying how to get the weights.

    Nothing is created or downloaded here (the weights are about 3 GB: fetching them is the user's call)."""
    problems = model_dir_problems(model_dir)
    if not problems:
        return
    if len(problems) == len(REQUIRED_FILES) and all(p.endswith(": missing") for p in problems):
        what = f"no CosyVoice2 weights in {model_dir} (none of {', '.join(REQUIRED_FILES)})"
    else:
        what = f"the CosyVoice2 weights in {model_dir} are incomplete: {'; '.join(problems)}"
    download = (
        f"{_shown_python()} -m cosyvoice_build --work-dir {model_dir.parent} --from download --to download"
    )
    if model_dir == DEFAULT_MODEL_DIR:
        get = f"download them (about 3 GB): `make weights` (= `{download}`)"
    elif model_dir.name == WEIGHTS_DIRNAME:
        get = f"download them (about 3 GB): `{download}`"
    else:
        target = model_dir.parent / WEIGHTS_DIRNAME
        get = (
            f"download them (about 3 GB) next to it: `{download}` "
            f"(writes {target}; then set COSYVOICE_MODEL_DIR={target})"
        )
    raise StackError(
        f"{what}.\n"
        f"  - {get}\n"
        f"  - or copy the official CosyVoice2-0.5B files (FunAudioLLM/CosyVoice2-0.5B) into {model_dir}\n"
        f"  - or set COSYVOICE_MODEL_DIR (or --model-dir) to the directory that holds them\n"
        f"  - or try the stack without weights: `make demo` (a tiny random model; its audio is noise)"
    )


def _write_demo_model(target: Path, what: str, write: Callable[[Path], object],
                      problems: Callable[[Path], list[str]]) -> Path:
    """`target`, holding the tiny random `what` model `write` puts there once (atomically: a directory is either
    complete or absent, also when two demos start together or one is interrupted); marked with DEMO_MARKER."""
    if (target / DEMO_MARKER).is_file() and not problems(target):
        _log(f"demo model: {target} ({what}, tiny, random weights)")
        return target
    if target.exists() and any(target.iterdir()) and not (target / DEMO_MARKER).is_file():
        raise StackError(
            f"{target} is not empty and holds no demo model: point --demo-dir / COSYVOICE_DEMO_DIR elsewhere"
        )
    _log(f"writing the demo model ({what}, tiny, random weights) to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(staging)
        (staging / DEMO_MARKER).write_text(
            f"A tiny {what} with random weights, written by `python -m triton_repo.local_stack --demo` for trying the\n"
            "serving stack without the real weights. Everything it says is noise. Safe to delete.\n",
            encoding="utf-8",
        )
        if target.exists():
            shutil.rmtree(target)  # an empty directory, or a damaged demo model of ours
        try:
            staging.rename(target)
        except OSError:
            # another demo finished first: use its model when it is complete
            if not ((target / DEMO_MARKER).is_file() and not problems(target)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_demo_model(demo_dir: Path) -> Path:
    """The demo's tiny random-weight CosyVoice2 in `demo_dir`, written there once (`_write_demo_model`)."""
    try:
        from cosyvoice2.testing import write_tiny_model  # noqa: PLC0415 - torch, only for the demo
    except ImportError as exc:
        raise StackError(f"the demo model is written with torch ({exc}): pip install -e '.[engine]'") from exc
    return _write_demo_model(demo_dir, "CosyVoice2", lambda path: write_tiny_model(path, seed=DEMO_SEED),
                             model_dir_problems)


def ensure_demo_cosyvoice3(demo_dir: Path) -> Path:
    """The demo's tiny random-weight CosyVoice3 (with its tokenizer and frontend models: everything serving reads)
    in `demo_dir`/DEMO_COSYVOICE3_SUBDIR, written there once like the CosyVoice2 one. Call it after
    `ensure_demo_model`: rewriting a damaged CosyVoice2 demo model removes this one, which is then written again."""
    from cosyvoice3.testing import write_tiny_model  # noqa: PLC0415 - torch, only for the demo

    return _write_demo_model(demo_dir / DEMO_COSYVOICE3_SUBDIR, "CosyVoice3",
                             lambda path: write_tiny_model(path, seed=DEMO_SEED, text_frontend=True),
                             released_dir_problems)


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
#: `python -m gateway`'s exit status when it could not start (gateway/__main__.py, `EXIT_CANNOT_START`): the
#: gateway said why, and starting it again would fail the same way.
GATEWAY_CANNOT_START = 3
#: Upper bound of the gateway's start-up check (settings and port); it imports the gateway's settings only.
GATEWAY_CHECK_TIMEOUT_S = 120.0


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
        env = {**self.gateway_env, "TTS_TRITON_URL": self.server.grpc_url}  # the ports of the first start
        self.gateway = spawn_tied([sys.executable, "-m", "gateway"], env=env, start_new_session=True)
        self._gateway_since = time.monotonic()
        _log(f"gateway started (pid {self.gateway.pid})")

    def _check_gateway(self) -> None:
        assert self.gateway is not None
        if self.gateway.poll() is None:
            return
        if self.gateway.returncode == GATEWAY_CANNOT_START:
            raise StackError(
                "the gateway could not start (its message is above); restarting it would fail the same way"
            )
        delay = self._gateway_backoff.delay(time.monotonic() - self._gateway_since)
        _log(f"the gateway exited with {self.gateway.returncode}; restarting in {delay:.0f} s")
        if not self.stop.wait(delay):
            self._start_gateway()

    # Lifecycle ------------------------------------------------------------------------------------
    def run(self) -> int:
        log_start = self.server.log_size()
        self._start_triton(ready_timeout=900)
        if not self._wait_started():
            if self._start_error is not None and not self.stop.is_set():
                if self.server.port_conflict_since(log_start):
                    raise StackError(self._triton_port_conflict()) from self._start_error
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

    def _triton_port_conflict(self) -> str:
        ports = ", ".join(
            f"{kind} {port} (COSYVOICE_TRITON_{kind.upper()}_PORT)"
            for kind, port in (("http", self.server.http_port), ("grpc", self.server.grpc_port),
                               ("metrics", self.server.metrics_port))
        )  # fmt: skip
        return (
            f"a tritonserver port is already in use: {ports}. Another program listens there, perhaps a stack "
            "started earlier. Set those variables (or --triton-*-port) to free ports, or unset them (0: free ports "
            f"are chosen). tritonserver's log: {self.server.log_path}"
        )

    def on_signal(self, sig: int) -> None:
        self.signals += 1
        self.stop.set()
        if self.signals > 1 and self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(sig)  # the gateway's second signal: exit now

    def shutdown(self) -> None:
        _log("stopping: draining the gateway")
        if self.gateway is not None:
            stop_process(self.gateway, GATEWAY_STOP_TIMEOUT_S)
        _log("gateway stopped; stopping tritonserver")
        self.server.stop(grace=CLEAN_STOP_S)  # every model unloaded, then it exits by itself
        self.server.cleanup()


def run_stack(
    model_dir: Path,
    repo_dir: Path | None,
    device: str,
    dtype: str,
    gateway_port: int | None,
    ports: TritonPorts,
    benchmark_speech_ratio: float | None = None,
    token2wav: str = "unet",
    dit_dir: Path | None = None,
    demo_dir: Path | None = None,
    spark_dir: Path | None = None,
    cosyvoice3_dir: Path | None = None,
) -> int:
    """Run the stack until a signal; `demo_dir` set: the demo (its random model instead of `model_dir`); `repo_dir`
    None: `triton_repo/` in the stack's own directory (`default_stack_dir`), the log beside it."""
    gateway_env = dict(os.environ)
    if gateway_port is not None:
        gateway_env["TTS_PORT"] = str(gateway_port)
    if demo_dir is not None:
        if token2wav != "unet":
            raise StackError("the demo runs its tiny model's own flow: leave --token2wav / COSYVOICE_TOKEN2WAV unset")
        if cosyvoice3_dir is not None:
            raise StackError("the demo serves its own tiny CosyVoice3: "
                             "leave --cosyvoice3-dir / COSYVOICE_COSYVOICE3_DIR unset")
        gateway_env["TTS_DEMO"] = "true"
    else:
        check_model_dir(model_dir)
    # Before anything slow (the demo model, the models' loading): a port in use or a bad setting is known at once.
    port = check_gateway(gateway_env)
    repo_dir = repo_dir or default_stack_dir(port) / "triton_repo"
    if demo_dir is not None:
        model_dir = ensure_demo_model(demo_dir)
        cosyvoice3_dir = ensure_demo_cosyvoice3(demo_dir)
        if benchmark_speech_ratio is None:
            benchmark_speech_ratio = DEMO_SPEECH_RATIO
        _log("DEMO: the pipeline runs random weights, its audio is NOISE; `make run` serves the real model")
    options = RenderOptions(
        model_dir=model_dir, out=repo_dir, device=device, dtype=dtype, benchmark_speech_ratio=benchmark_speech_ratio,
        token2wav=token2wav, dit_dir=dit_dir, spark=SparkRenderOptions(spark_dir) if spark_dir is not None else None,
        cosyvoice3=cosyvoice3_options(cosyvoice3_dir, benchmark_speech_ratio if demo_dir is not None else None),
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
    # Triton ports left at 0 are chosen by the first start (retried on a conflict) and kept by every restart.
    supervisor = Supervisor(server, gateway_env, threading.Event())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: supervisor.on_signal(number))
    try:
        return supervisor.run()
    finally:
        supervisor.shutdown()


def cosyvoice3_options(cosyvoice3_dir: Path | None, benchmark_ratio: float | None) -> CosyVoice3RenderOptions | None:
    """CosyVoice3's render part (None: not served); the demo's random CosyVoice3 in benchmark mode at
    `benchmark_ratio` (its text tokens are the same byte-level kind as the demo CosyVoice2's: the same pace)."""
    if cosyvoice3_dir is None:
        return None
    return CosyVoice3RenderOptions(cosyvoice3_dir, benchmark_ratio=benchmark_ratio)


def check_gateway(gateway_env: dict[str, str]) -> int:
    """The gateway's port, or StackError unless the gateway would start with these settings: `python -m gateway
    --check` in the gateway's own environment (its settings, its `.env`), which prints what to change."""
    check = subprocess.run(  # noqa: S603 - our own module
        [sys.executable, "-m", "gateway", "--check"], env=gateway_env, timeout=GATEWAY_CHECK_TIMEOUT_S, check=False,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    if check.returncode != 0:
        raise StackError(f"the gateway cannot start (its message is above; `python -m gateway --check` exited "
                         f"with {check.returncode}); nothing was started")
    return int(check.stdout.strip().rsplit(":", 1)[1])


def _env_port(name: str) -> int:
    value = os.environ.get(name, "0").strip() or "0"
    if not value.isdigit() or int(value) > 65535:
        raise StackError(f"{name} must be a port number (0 = a free one), not {value!r}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_repo.local_stack", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, default=Path(os.environ.get("COSYVOICE_MODEL_DIR", DEFAULT_MODEL_DIR))
    )
    parser.add_argument("--repo-dir", type=Path, default=None,
                        help="where the repository is rendered, tritonserver.log beside it "
                             "(default: var/stack-<gateway port>/triton_repo)")
    parser.add_argument("--device", default=os.environ.get("COSYVOICE_DEVICE", "cpu"), choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=os.environ.get("COSYVOICE_DTYPE", "fp32"), choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--port", type=int, default=None, help="gateway port (default: TTS_PORT or 8080)")
    parser.add_argument("--token2wav", default=os.environ.get("COSYVOICE_TOKEN2WAV", "unet"), choices=TOKEN2WAVS,
                        help="unet: CosyVoice2's flow; dit: the DiT flow of Step-Audio-2-mini (needs --dit-dir)")
    parser.add_argument("--dit-dir", type=Path, default=os.environ.get("COSYVOICE_DIT_DIR") or None,
                        help="the released token2wav/ directory (default: COSYVOICE_DIT_DIR)")
    parser.add_argument("--demo", action="store_true",
                        help="no weights needed: a tiny random model (its audio is noise) for wiring up clients")
    parser.add_argument("--demo-dir", type=Path, default=os.environ.get("COSYVOICE_DEMO_DIR") or _default_demo_dir(),
                        help="where the demo model is written once (default: COSYVOICE_DEMO_DIR, else the user cache)")
    parser.add_argument("--spark-dir", type=Path, default=os.environ.get("COSYVOICE_SPARK_DIR") or None,
                        help="a Spark-TTS model directory to serve beside CosyVoice2 (default: COSYVOICE_SPARK_DIR)")
    parser.add_argument("--cosyvoice3-dir", type=Path, default=os.environ.get("COSYVOICE_COSYVOICE3_DIR") or None,
                        help="a CosyVoice3 model directory to serve beside CosyVoice2 "
                             "(default: COSYVOICE_COSYVOICE3_DIR)")
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
            args.model_dir.resolve(), args.repo_dir.resolve() if args.repo_dir else None, args.device, args.dtype,
            args.port, ports,
            args.benchmark_speech_ratio, args.token2wav,
            Path(args.dit_dir).resolve() if args.dit_dir else None,
            Path(args.demo_dir).resolve() if args.demo else None,
            Path(args.spark_dir).resolve() if args.spark_dir else None,
            Path(args.cosyvoice3_dir).resolve() if args.cosyvoice3_dir else None,
        )  # fmt: skip
    except (StackError, RenderError, TritonLaunchError) as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
