"""The rendered stack the whole-stack tools start on one machine: the weights (released-size random ones written
once under a work directory unless a model directory is given), the repository rendered for a device and dtype
(in benchmark mode for random weights; Spark-TTS or CosyVoice3 beside CosyVoice2 when asked), tritonserver with
its python stubs in a chosen Python environment, and the gateway in front of it. `stack-bench` (``stackbench.cli``)
and the soak (`tests/reliability/soak.py --full-size`) start it this way, so both measure the same stack.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pipeline_contract as contract
from triton_repo.render import CosyVoice3RenderOptions, RenderOptions, write_repository
from triton_repo.server import REPO_ROOT, TritonServer, default_stub_env, free_port, spawn_tied, stop_process
from triton_repo.spark_render import SparkRenderOptions

SPEECH_TOKENS_PER_CHAR = 1.67  # 25 speech tokens per second / ~15 characters per second of read English
SPARK_TOKENS_PER_CHAR = 3.33  # Spark: 50 semantic tokens per second / ~15 characters per second
#: Gateway starts on a new free port after one exited (another process took the port first).
GATEWAY_START_ATTEMPTS = 3
#: Loading the released-size models (and compiling their kernels) on a cold machine takes minutes.
TRITON_READY_TIMEOUT_S = 900.0
GATEWAY_READY_TIMEOUT_S = 120.0


def sentences_ratio(tokens_per_char: float, encode: Callable[[str], Sequence[int]]) -> float:
    """Generated tokens per text token that give the built-in sentences ``tokens_per_char`` with a tokenizer
    (random full-size models ship a tiny tokenizer with many more tokens per character than the released ones)."""
    from ttsbench.sentences import SENTENCES

    chars = sum(len(s) for s in SENTENCES)
    return round(tokens_per_char * chars / sum(len(encode(s)) for s in SENTENCES), 3)


def realistic_ratio(model_dir: Path) -> float:
    """Speech tokens per text token that give the built-in sentences natural durations with this tokenizer."""
    from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer

    return sentences_ratio(SPEECH_TOKENS_PER_CHAR, CosyVoice2Tokenizer.from_model_dir(model_dir).encode)


def realistic_spark_ratio(spark_dir: Path) -> float:
    """`realistic_ratio` for Spark-TTS: semantic tokens per token of Spark's tokenizer."""
    from spark_tts.prompt import SparkTokenizer

    return sentences_ratio(SPARK_TOKENS_PER_CHAR, SparkTokenizer.from_model_dir(spark_dir).encode)


def realistic_cosyvoice3_ratio(cosyvoice3_dir: Path) -> float:
    """`realistic_ratio` for CosyVoice3: its speech tokens (25 per second, as CosyVoice2's) per token of its
    tokenizer."""
    from cosyvoice3.text import CosyVoice3Tokenizer

    return sentences_ratio(SPEECH_TOKENS_PER_CHAR, CosyVoice3Tokenizer.from_model_dir(cosyvoice3_dir).encode)


def random_weights(path: Path, write: Callable[[Path], Any], what: str) -> Path:
    """`path`, holding random weights `write` puts there on the first use. They are written into a sibling
    `.partial` directory renamed when complete: an interrupted write is never taken for a model, it is redone."""
    if path.is_dir():
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    write(partial)
    partial.rename(path)
    print(f"wrote random {what} weights to {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return path


def write_random_model(path: Path) -> None:
    from cosyvoice2.testing import write_full_size_random_model  # noqa: PLC0415 - only when no --model-dir

    write_full_size_random_model(path)


def write_random_dit(path: Path) -> None:
    from cosyvoice2.testing.dit import write_full_size_random_dit  # noqa: PLC0415 - only when no --dit-dir

    write_full_size_random_dit(path)


def write_random_spark(path: Path) -> None:
    from spark_tts.testing import write_full_size_random_model  # noqa: PLC0415 - only when no --spark-dir

    write_full_size_random_model(path)


def write_random_cosyvoice3(path: Path) -> None:
    from cosyvoice3.testing import write_full_size_model  # noqa: PLC0415 - only when no --cosyvoice3-dir

    write_full_size_model(path, text_frontend=True)  # serving reads the tokenizer and the frontend models too


def write_tiny_cosyvoice3(path: Path) -> None:
    from cosyvoice3.testing import write_tiny_model  # noqa: PLC0415 - only when no --cosyvoice3-dir

    write_tiny_model(path, text_frontend=True)


def ensure_model_dir(work: Path, model_dir: Path | None) -> Path:
    """``model_dir`` as given, else released-size random weights under WORK/model (written once, then reused)."""
    return model_dir or random_weights(work / "model", write_random_model, "full-size CosyVoice2")


def ensure_dit_dir(work: Path, dit_dir: Path | None) -> Path:
    """``dit_dir`` as given, else a released-size random DiT token2wav under WORK/dit (written once, then reused)."""
    return dit_dir or random_weights(work / "dit", write_random_dit, "full-size DiT token2wav")


def ensure_spark_dir(work: Path, spark_dir: Path | None) -> Path:
    """``spark_dir`` as given, else released-size random Spark-TTS weights under WORK/spark-model (written once,
    then reused)."""
    return spark_dir or random_weights(work / "spark-model", write_random_spark, "full-size Spark-TTS")


def ensure_cosyvoice3_dir(work: Path, cosyvoice3_dir: Path | None, device: str) -> Path:
    """``cosyvoice3_dir`` as given, else random CosyVoice3 weights written once, then reused: released-size ones
    (dense, 3.4 GB) under WORK/cosyvoice3-model for CUDA; on the CPU the tiny model under WORK/cosyvoice3-tiny
    (the released size decodes far slower than real time there: a CPU run checks the wiring, not the speed)."""
    if cosyvoice3_dir is not None:
        return cosyvoice3_dir
    if device == "cuda":
        return random_weights(work / "cosyvoice3-model", write_random_cosyvoice3, "full-size CosyVoice3")
    return random_weights(work / "cosyvoice3-tiny", write_tiny_cosyvoice3, "tiny CosyVoice3")


#: The optional pipelines' own render options, set by ``PART.FIELD=VALUE`` items (cosyvoice3.flow_cache=chunked).
NESTED_OPTIONS = {"spark": SparkRenderOptions, "cosyvoice3": CosyVoice3RenderOptions}


def render_fields(items: Sequence[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` items (--render-arg) as RenderOptions keyword arguments (integers as int); a
    ``PART.FIELD=VALUE`` item (PART one of `NESTED_OPTIONS`) keeps its dotted key (`nested_fields`)."""
    extra: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        extra[key] = int(value) if value.lstrip("-").isdigit() else value
    return extra


def nested_fields(fields: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """`render_fields`' keywords split into RenderOptions' own and, per optional pipeline, its options'."""
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {part: {} for part in NESTED_OPTIONS}
    for key, value in fields.items():
        part, dot, name = key.partition(".")
        if not dot:
            own[key] = value
        elif part in nested and name:
            nested[part][name] = value
        else:
            raise SystemExit(f"stack-bench: render item {key}: only {', '.join(NESTED_OPTIONS)} have options of "
                             "their own (PART.FIELD=VALUE)")
    return own, nested


def benchmark_ratio(given: float | None, realistic: Callable[[], float], announce: str) -> float | None:
    """A model's benchmark ratio as rendered: ``given``; None: the realistic one (``realistic()``, announced with
    ``announce``); 0: off (None, for real weights)."""
    if given is None:
        given = realistic()
        print(announce.format(given), flush=True)
    return given or None


def render_stack(
    *, work: Path, model_dir: Path, device: str, dtype: str, max_batch: int | None, max_seq_len: int,
    benchmark_speech_ratio: float | None, render_args: Sequence[str] = (), token2wav: str = "unet",
    dit_dir: Path | None = None, spark_dir: Path | None = None, spark_benchmark_ratio: float | None = None,
    cosyvoice3_dir: Path | None = None, cosyvoice3_benchmark_ratio: float | None = None,
) -> tuple[RenderOptions, Path]:  # fmt: skip
    """Render WORK/repo, with Spark-TTS beside CosyVoice2 when ``spark_dir`` is given, CosyVoice3 when
    ``cosyvoice3_dir`` is. A benchmark ratio of None picks the realistic one for that model's tokenizer; 0 turns
    benchmark mode off (real weights stop by themselves)."""
    own, nested = nested_fields(render_fields(render_args))
    rendered = {"spark": spark_dir is not None, "cosyvoice3": cosyvoice3_dir is not None}
    for part, given in nested.items():
        if given and not rendered[part]:
            raise SystemExit(f"stack-bench: render items {', '.join(f'{part}.{k}' for k in given)} need --{part}")
    ratio = benchmark_speech_ratio
    if ratio is None:
        ratio = realistic_ratio(model_dir)
        print(f"benchmark mode: {ratio} speech tokens per text token", flush=True)
    spark = cosyvoice3 = None
    if spark_dir is not None:
        spark_ratio = benchmark_ratio(spark_benchmark_ratio, lambda: realistic_spark_ratio(spark_dir),
                                      "Spark benchmark mode: {} semantic tokens per text token")
        spark = SparkRenderOptions(model_dir=spark_dir, benchmark_ratio=spark_ratio, **nested["spark"])
    if cosyvoice3_dir is not None:
        cosyvoice3_ratio = benchmark_ratio(cosyvoice3_benchmark_ratio,
                                           lambda: realistic_cosyvoice3_ratio(cosyvoice3_dir), "CosyVoice3 benchmark mode: {} speech tokens per text token")
        cosyvoice3 = CosyVoice3RenderOptions(model_dir=cosyvoice3_dir, benchmark_ratio=cosyvoice3_ratio,
                                             **nested["cosyvoice3"])
    options = RenderOptions(
        model_dir=model_dir, out=work / "repo", device=device, dtype=dtype, max_batch=max_batch,
        max_seq_len=max_seq_len, benchmark_speech_ratio=ratio or None, token2wav=token2wav, dit_dir=dit_dir,
        spark=spark, cosyvoice3=cosyvoice3,
        **own,
    )  # fmt: skip
    return options, write_repository(options)


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


@dataclass
class BenchStack:
    """tritonserver on a rendered repository (stubs in ``stub_env``, default: `default_stub_env`) and, on demand,
    a gateway in front of it run by this interpreter. With ``replica_devices`` one tritonserver per entry serves
    the same repository, each seeing only that device (its ``CUDA_VISIBLE_DEVICES``) on ports of its own, and the
    gateway targets them all round robin (`grpc_target`). Logs: WORK/tritonserver.log (the first server;
    WORK/tritonserver-<i>.log the others) and WORK/gateway.log, emptied at construction so they hold this run's
    lines only."""

    repo: Path
    work: Path
    stub_env: Path | None = None
    gateway_env: dict[str, str] = field(default_factory=dict)
    #: CUDA_VISIBLE_DEVICES of each server; empty: one server that sees the devices this process sees.
    replica_devices: Sequence[str] = ()
    #: extra tritonserver arguments of every server (`stack-bench --server-arg`)
    server_args: tuple[str, ...] = ()
    servers: list[TritonServer] = field(init=False)
    gateway: subprocess.Popen | None = field(default=None, init=False)
    gateway_port: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        envs = [{"CUDA_VISIBLE_DEVICES": device} for device in self.replica_devices] or [{}]
        self.servers = [
            TritonServer(model_repository=self.repo, log_path=self.server_log_of(i),
                         env_prefix=self.stub_env or default_stub_env(), extra_env=env, extra_args=self.server_args)
            for i, env in enumerate(envs)
        ]  # fmt: skip
        for log in (*self.server_logs, self.gateway_log):
            log.unlink(missing_ok=True)

    @property
    def server(self) -> TritonServer:
        """The first (or only) tritonserver."""
        return self.servers[0]

    def server_log_of(self, replica: int) -> Path:
        return self.work / ("tritonserver.log" if replica == 0 else f"tritonserver-{replica}.log")

    @property
    def server_logs(self) -> list[Path]:
        return [self.server_log_of(i) for i in range(len(self.servers))]

    @property
    def server_log(self) -> Path:
        return self.server_log_of(0)

    @property
    def gateway_log(self) -> Path:
        return self.work / "gateway.log"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def grpc_target(self) -> str:
        """The gRPC target of every server: the one address, or a round-robin list of all (``ipv4:a,b``)."""
        return contract.grpc_target([server.grpc_url for server in self.servers])

    def start_triton(self, ready_timeout: float = TRITON_READY_TIMEOUT_S) -> None:
        # One after the other: servers loading at once would share the CPU and the kernel caches while compiling.
        for server in self.servers:
            server.start(ready_timeout=ready_timeout)

    def start_gateway(self, ready_timeout: float = GATEWAY_READY_TIMEOUT_S) -> None:
        # A port free when chosen may be taken before the gateway binds it (it then exits): a new one.
        for attempt in range(1, GATEWAY_START_ATTEMPTS + 1):
            self.gateway_port = free_port()
            env = {**os.environ, "TTS_TRITON_URL": self.grpc_target, "TTS_PORT": str(self.gateway_port),
                   "TTS_HOST": "127.0.0.1", **self.gateway_env}  # fmt: skip
            with open(self.gateway_log, "ab") as log:
                self.gateway = spawn_tied([sys.executable, "-m", "gateway"], env=env, cwd=REPO_ROOT, stdout=log,
                                          stderr=subprocess.STDOUT)
            try:
                wait_http_ok(f"{self.gateway_url}/ready", ready_timeout, self.gateway)
                return
            except RuntimeError:
                if self.gateway.poll() is None or attempt == GATEWAY_START_ATTEMPTS:
                    raise

    def stop(self) -> None:
        if self.gateway is not None:
            stop_process(self.gateway, 10)
        for server in self.servers:
            server.cleanup()
