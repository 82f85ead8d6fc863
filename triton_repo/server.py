"""Start and stop the `tritonserver` binary shipped in the `nvidia-pytriton` wheel.

Used by the local stack (`make run`) and by the test fixtures. The facts behind each step are in
docs/triton.md: the python-backend stub must sit in a private backend dir, find its
libraries through LD_LIBRARY_PATH, and run in an environment with numpy < 2; a server with a stream
in flight ignores SIGTERM, so stopping ends with SIGKILL of the whole process group. Every server (and the
stacks' gateways) is tied to the process that started it: it gets SIGTERM when that process dies (`spawn_tied`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class TritonLaunchError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready."""


#: tritonserver's own deadline, after SIGTERM, for the requests in flight and for unloading every model
#: (`--exit-timeout-secs`). The pipeline's python-backend models take seconds each to finalize on a loaded CPU;
#: at 3 s every stop ended in "Exit timeout expired. Exiting immediately." with the models still loaded.
EXIT_TIMEOUT_S = 30
#: A clean stop waits this long for tritonserver to exit by itself (then KILL): its exit timeout and a margin.
CLEAN_STOP_S = EXIT_TIMEOUT_S + 5.0

#: Threads of tritonserver's python backend that pass responses and BLS requests between the model processes and
#: the server (`--backend-config=python,thread-pool-size`): more than the streams a GPU serves at once.
PYTHON_BACKEND_THREADS = 128

#: What every tritonserver of the project is started with: the local stack's (here) and the containers'
#: (`triton_repo.launch`).
SERVING_ARGS = (
    f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
    # The pipeline's clients keep their connections alive with a ping every 30 s, idle or not
    # (pipeline_contract.GRPC_CHANNEL_ARGS). tritonserver's defaults allow one ping per 5 minutes without data and
    # answer more with GOAWAY "too_many_pings", which drops every stream on that connection.
    "--grpc-keepalive-permit-without-calls=1",
    "--grpc-http2-max-pings-without-data=0",
    "--grpc-http2-min-recv-ping-interval-without-data=10000",
    # The python backend hands every response a model sends, and every BLS request it makes, to a pool of threads
    # in tritonserver (32 by default, per backend). At 64 streams the streaming orchestrator's sends queued behind
    # it: a first chunk waited ~1 s in the hand-overs (docs/experiments/2026-11-27-python-backend-thread-pool.md).
    f"--backend-config=python,thread-pool-size={PYTHON_BACKEND_THREADS}",
)


def serving_arg_key(arg: str) -> str:
    """What an argument sets, so that one given explicitly replaces the serving default: the flag, or for
    `--backend-config=BACKEND,SETTING=VALUE` the backend's setting (there are many backend configs)."""
    flag, _, value = arg.partition("=")
    return f"{flag}={value.partition('=')[0]}" if flag == "--backend-config" else flag

#: How far past its deadline a start may go while tritonserver keeps working (`wait_ready`), and how long without
#: any CPU used by it and its model processes counts as stalled.
READY_STRETCH = 3.0
READY_STALL_S = 60.0

#: How tritonserver (gRPC and HTTP) reports a port another process holds.
PORT_CONFLICT_MARK = "already in use"
PORT_CONFLICT_ATTEMPTS = 3


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now. Their sockets are held open together while chosen: ports chosen one at a
    time (each socket closed before the next bind) can be the same port twice, and tritonserver refuses the same
    port for two of its endpoints."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


def stop_process(proc: subprocess.Popen, grace: float, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to a child still running, give it `grace` seconds to exit, then KILL it and reap it."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


#: prctl(2) option: the signal the calling process gets when its parent dies (Linux).
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _die_with(parent: int) -> None:
    """In the child between fork and exec: SIGTERM when `parent` dies; exit at once if it already has."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def spawn_tied(cmd: list[str], **popen: object) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **popen)` for a process that must not outlive this one (Linux): it gets SIGTERM when
    this process dies, however it dies. A tritonserver runs in a session of its own (so that it is stopped as a
    group), where no terminal's hang-up reaches it: a test run or a benchmark killed by a timeout left its servers
    running and holding GPU memory. The kernel sends the signal when the *thread* that forked the child exits, so
    every such child is forked by one thread that lives as long as the process (a local stack starts tritonserver
    from a short-lived thread)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawn-tied")
    parent = os.getpid()
    return _spawner.submit(subprocess.Popen, cmd, preexec_fn=lambda: _die_with(parent), **popen).result()


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far) of every process (Linux /proc; empty elsewhere)."""
    table: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)  # ppid; utime + stime
    return table


def process_tree(pid: int, table: dict[int, tuple[int, float]] | None = None) -> set[int]:
    """`pid` and all its descendants (tritonserver: its python stub processes)."""
    parents = {child: ppid for child, (ppid, _) in (table if table is not None else _process_table()).items()}
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and all its descendants (Linux /proc; 0 elsewhere)."""
    table = _process_table()
    return sum(table[member][1] for member in process_tree(pid, table) if member in table)


class _CpuProgress:
    """When a process tree last used CPU: sampled at most once a second (a /proc scan is not free)."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid
        self._last_sample = self._last_progress = time.monotonic()
        self._cpu = process_tree_cpu_seconds(pid) if pid is not None else 0.0

    def idle_s(self) -> float:
        now = time.monotonic()
        if self._pid is not None and now - self._last_sample >= 1.0:
            self._last_sample = now
            cpu = process_tree_cpu_seconds(self._pid)
            if cpu > self._cpu + 0.01:
                self._cpu, self._last_progress = cpu, now
        return now - self._last_progress


def _pytriton_dir() -> Path:
    # Locate the wheel without importing it: only its binaries are needed, not its client's dependencies.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - depends on install
        raise TritonLaunchError("nvidia-pytriton is not installed: pip install '.[triton]'")
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "tritonserver"


#: The stubs' own environment that scripts/gpu_setup.sh makes where the machine's Python has numpy 2 (NGC images).
DEFAULT_STUB_ENV = REPO_ROOT / ".venv-stub"


def numpy_major(env_prefix: Path) -> int | None:
    """The major version of the numpy installed in the Python environment at `env_prefix` (None: none found)."""
    if Path(env_prefix).resolve() == Path(sys.prefix).resolve():
        try:
            return int(importlib.metadata.version("numpy").split(".")[0])
        except importlib.metadata.PackageNotFoundError:
            return None
    versions = [int(info.name.split("-")[1].split(".")[0])
                for info in Path(env_prefix).glob("lib/python3*/site-packages/numpy-*.dist-info")]  # fmt: skip
    return min(versions) if versions else None


def default_stub_env() -> Path:
    """Where the python-backend stubs run by default: this interpreter's environment, unless its numpy is 2 or newer
    and the separate stub environment (`DEFAULT_STUB_ENV`) exists."""
    here = Path(sys.prefix)
    if (numpy_major(here) or 0) >= 2 and (DEFAULT_STUB_ENV / "bin" / "python3").exists():
        return DEFAULT_STUB_ENV
    return here


def check_stub_env(env_prefix: Path) -> None:
    """TritonLaunchError unless the stubs can run in `env_prefix`: Triton 2.51's python-backend stub is built for
    numpy 1; under numpy 2 it reads tensors wrongly (string inputs came back as their first byte repeated, outputs
    empty), so a server there would start and then fail its requests."""
    major = numpy_major(env_prefix)
    if major is not None and major >= 2:
        raise TritonLaunchError(
            f"the Python environment of the tritonserver stubs ({env_prefix}) has numpy {major}.x, and the "
            "python-backend stub needs numpy < 2: run scripts/gpu_setup.sh (it makes a stub environment, "
            f"{DEFAULT_STUB_ENV}, used by default when present) or give one (stack-bench --stub-env DIR)"
        )


def libpython_dir(workdir: Path) -> Path | None:
    """A directory holding only this interpreter's libpython (a link to it), for the stub's LD_LIBRARY_PATH; None
    when the interpreter has no shared libpython to point at.

    The python-backend stub links `libpython3.X.so.1.0` and must find ours, not a distribution's. Putting the
    interpreter's whole LIBDIR on LD_LIBRARY_PATH did that, but LD_LIBRARY_PATH is searched before the RUNPATH of
    torch's wheels: where LIBDIR is a system directory (/usr/lib/x86_64-linux-gnu, the GPU images' Python), the
    CUDA libraries installed there (cuDNN's engine libraries among them) shadowed the ones torch ships with, and the
    LLM's decode step ran 1.92 ms on the GPU instead of 1.40 (H200, `enginebench.llm_step_paths` with the stub's
    library path). The link puts libpython, and nothing else, ahead."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not soname or ".so" not in soname or not (Path(libdir) / soname).exists():
        return None  # a static build (INSTSONAME libpython3.X.a) has nothing the stub could link
    target = workdir / "libpython"
    target.mkdir(parents=True, exist_ok=True)
    link = target / soname
    if not link.is_symlink():
        link.symlink_to(Path(libdir) / soname)
    return target


@dataclass
class TritonServer:
    """One tritonserver process on loopback with free ports.

    ``env_prefix`` is the Python environment the python-backend stubs run in (it must have numpy < 2
    and whatever the models import); by default the running interpreter's, or the separate stub environment where
    that one has numpy 2 (`default_stub_env`). A start in an environment with numpy 2 fails at once.
    """

    model_repository: Path
    env_prefix: Path = field(default_factory=default_stub_env)
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_path: Path | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _workdir: Path | None = field(default=None, init=False, repr=False)

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def shm_prefix(self) -> str:
        return f"cvs{self.grpc_port}_"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def exited(self) -> bool:
        """Started, and the process has ended since (crashed or killed), not stopped by us."""
        return self._proc is not None and self._proc.poll() is not None

    def start(self, ready_timeout: float = 120.0) -> TritonServer:
        """Start and wait until ready. Ports left at 0 are chosen here and kept (a restart reuses them); as a
        free port may be taken by another process before tritonserver binds it, a start that fails on a port
        conflict is retried on newly chosen ones (pinned ports are never changed)."""
        if self._proc is not None:
            raise TritonLaunchError("server already started")
        chosen = [attr for attr in ("http_port", "grpc_port", "metrics_port") if not getattr(self, attr)]
        for attempt in range(1, PORT_CONFLICT_ATTEMPTS + 1):
            for attr, port in zip(chosen, free_ports(len(chosen))):
                setattr(self, attr, port)
            log_start = self.log_size()
            try:
                return self._start_once(ready_timeout)
            except TritonLaunchError:
                if not chosen or attempt == PORT_CONFLICT_ATTEMPTS or not self.port_conflict_since(log_start):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def log_size(self) -> int:
        """Bytes in the log now: what a later `port_conflict_since` reads from."""
        return self.log_path.stat().st_size if self.log_path is not None and self.log_path.exists() else 0

    def port_conflict_since(self, offset: int) -> bool:
        """Whether tritonserver reported a port another process holds in its log after `offset`."""
        if self.log_path is None or not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return PORT_CONFLICT_MARK in log.read().decode(errors="replace")

    def _start_once(self, ready_timeout: float) -> TritonServer:
        check_stub_env(self.env_prefix)
        ts_dir = _pytriton_dir()
        if self._workdir is None:  # a restart (same ports) reuses the backend dir and log
            self._workdir = Path(tempfile.mkdtemp(prefix="tritonserver-"))
        backends = self._workdir / "backends"
        if not backends.exists():
            self._make_backend_dir(ts_dir, backends)
        if self.log_path is None:
            self.log_path = self._workdir / "tritonserver.log"
        overridden = {serving_arg_key(arg) for arg in self.extra_args}  # e.g. stack-bench --server-arg
        cmd = [
            str(ts_dir / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            "--strict-readiness=true",
            "--exit-on-error=true",
            "--disable-auto-complete-config",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            *(arg for arg in SERVING_ARGS if serving_arg_key(arg) not in overridden),
            "--backend-config=python,shm-default-byte-size=4194304",
            "--backend-config=python,shm-growth-byte-size=4194304",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self._proc = spawn_tied(cmd, env=self._env(ts_dir), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            self.wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self, ts_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
        libs = [str(ts_dir.parent.parent / "nvidia_pytriton.libs")]
        assert self._workdir is not None  # made by the start that asks
        pylib = libpython_dir(self._workdir)
        if pylib is not None:
            libs.append(str(pylib))
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        # The stub resolves its Python environment from `python3` on PATH.
        env["PATH"] = f"{self.env_prefix / 'bin'}:{env.get('PATH', '')}"
        # Models import our packages from this checkout, whatever is installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.extra_env)
        return env

    @staticmethod
    def _make_backend_dir(ts_dir: Path, backends: Path) -> None:
        py = backends / "python"
        py.mkdir(parents=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(ts_dir / "backends" / "python" / name, py / name)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = ts_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise TritonLaunchError(f"no python backend stub for Python {version} in {stub.parent.parent}")
        shutil.copy2(stub, py / stub.name)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        return self._answers(f"{self.http_url}/v2/health/ready")

    def wait_ready(self, timeout: float) -> None:
        """Until the models are ready and the metrics endpoint answers too: tritonserver reports ready over
        HTTP/gRPC a few milliseconds before it opens its metrics port, and a caller that reads the metrics first
        thing (a benchmark taking its baseline) would find it closed.

        `timeout` is the deadline on a machine that keeps up. Past it the wait goes on while tritonserver and its
        model processes still use CPU (loading on a machine busy with other work: what it needs is CPU time, not
        wall time), up to `READY_STRETCH` times `timeout`; a server that stalls (no CPU for `READY_STALL_S`) fails.
        """
        started = time.monotonic()
        progress = _CpuProgress(self._proc.pid if self._proc is not None else None)
        while True:
            if self._proc is None or self._proc.poll() is not None:
                raise TritonLaunchError(f"tritonserver exited early; log:\n{self.log_tail()}")
            if self.is_ready() and self._answers(self.metrics_url):
                return
            waited = time.monotonic() - started
            if waited > timeout:
                stalled = progress.idle_s() > READY_STALL_S
                if stalled or waited > timeout * READY_STRETCH:
                    why = f"no CPU used for {READY_STALL_S:.0f} s" if stalled else "still loading"
                    raise TritonLaunchError(
                        f"tritonserver not ready after {waited:.0f} s ({why}); log:\n{self.log_tail()}"
                    )
            time.sleep(0.2)

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace: float = 5.0) -> None:
        """TERM tritonserver, a grace period, then KILL the process group; remove leaked shm regions. With a
        grace of `CLEAN_STOP_S` tritonserver unloads every model (their `finalize`) before it exits; the test
        fixtures keep the short default (a teardown needs no clean unload)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # tritonserver alone: it finalizes its model processes itself (they must not get the TERM first)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            # Orphaned stubs stay in the group and ignore TERM: always KILL the whole group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            with contextlib.suppress(OSError):
                region.unlink()

    def cleanup(self) -> None:
        self.stop()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
