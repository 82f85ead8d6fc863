"""The local stack (`make run`): render the repository with the PyTorch LLM (the default, colocated
layout: LLM and token2wav in one `engine` process), start the bundled tritonserver and the gateway in
front of it; Ctrl-C (SIGINT) or SIGTERM stops both.

    python -m triton_repo.stack [--model-dir models/CosyVoice2-0.5B] [--device cpu|cuda] [--port 8080]

Settings come from the command line or the environment: `COSYVOICE_MODEL_DIR` (the model directory),
`COSYVOICE_DEVICE`, `COSYVOICE_DTYPE`, and the gateway's own `TTS_*` variables (its port, voices, ...).
When the model directory is missing or empty the build tooling's `download` stage fetches it, if that
tooling is installed; otherwise the launcher says what to put where.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

from triton_repo.render import MODEL_FILES, RenderError, RenderOptions, write_repository
from triton_repo.server import REPO_ROOT, TritonLaunchError, TritonServer

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


def run_stack(model_dir: Path, repo_dir: Path, device: str, dtype: str, gateway_port: int | None) -> int:
    ensure_model_dir(model_dir)
    repo = write_repository(RenderOptions(model_dir=model_dir, out=repo_dir, device=device, dtype=dtype))
    print(f"[stack] rendered {repo}; starting tritonserver (loading models takes a while)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = TritonServer(model_repository=repo, log_path=repo_dir.parent / "tritonserver.log")
    gateway: subprocess.Popen | None = None
    try:
        server.start(ready_timeout=900)
        print(
            f"[stack] tritonserver ready: grpc {server.grpc_url}, metrics :{server.metrics_port}, log {server.log_path}",
            flush=True,
        )
        env = {**os.environ, "TTS_TRITON_URL": server.grpc_url}
        if gateway_port is not None:
            env["TTS_PORT"] = str(gateway_port)
        # its own process group: Ctrl-C reaches us once, and we stop the gateway ourselves
        gateway = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, start_new_session=True)  # noqa: S603
        print("[stack] gateway started; Ctrl-C stops everything", flush=True)
        while not stop.wait(0.5):
            if gateway.poll() is not None:
                print(f"[stack] the gateway exited with {gateway.returncode}", flush=True)
                return gateway.returncode or 1
            if not server.is_ready():
                print(f"[stack] tritonserver is no longer ready; log tail:\n{server.log_tail(20)}", flush=True)
                return 1
        return 0
    finally:
        print("[stack] stopping", flush=True)
        if gateway is not None and gateway.poll() is None:
            gateway.send_signal(signal.SIGINT)
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                gateway.kill()
        server.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_repo.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, default=Path(os.environ.get("COSYVOICE_MODEL_DIR", DEFAULT_MODEL_DIR))
    )
    parser.add_argument("--repo-dir", type=Path, default=DEFAULT_REPO_DIR, help="where the repository is rendered")
    parser.add_argument("--device", default=os.environ.get("COSYVOICE_DEVICE", "cpu"), choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=os.environ.get("COSYVOICE_DTYPE", "fp32"), choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--port", type=int, default=None, help="gateway port (default: TTS_PORT or 8080)")
    args = parser.parse_args(argv)
    try:
        return run_stack(args.model_dir.resolve(), args.repo_dir.resolve(), args.device, args.dtype, args.port)
    except (StackError, RenderError, TritonLaunchError) as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
