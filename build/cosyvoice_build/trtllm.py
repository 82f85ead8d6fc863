"""The TensorRT-LLM engine stage: HF checkpoint -> TRT-LLM checkpoint -> engine, plus build_meta.json.

Two commands, both logged and run as subprocesses:

1. ``python -m cosyvoice_build.trtllm_convert`` (our wrapper of TRT-LLM's ``QWenForCausalLM.from_hugging_face``,
   with the flags of TRT-LLM's Qwen ``convert_checkpoint.py`` example; the example's path differs between images);
2. ``trtllm-build`` with explicit shapes and plugins.

TensorRT-LLM exists only as NVIDIA's GPU wheels/images, so when it is not importable the stage stops at once and
says where to run it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from cosyvoice_build.engine_meta import BuildMeta, RuntimeInfo, write_build_meta
from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings, TrtllmOptions
from cosyvoice_build.vocab_layout import LAYOUT_FILE

log = logging.getLogger("cosyvoice_build")

TRTLLM_IMAGE = "nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3"
MISSING_TRTLLM = (
    "tensorrt_llm is not importable here. TensorRT-LLM needs an NVIDIA GPU and NVIDIA's own wheels; run this stage "
    f"inside the {TRTLLM_IMAGE} image (docker/triton.Dockerfile, `docker compose run --rm build`), "
    "or use the PyTorch LLM backend (--llm-backend torch, compose profile `torch`), which needs no engine."
)


def require_tensorrt_llm() -> None:
    if importlib.util.find_spec("tensorrt_llm") is None or shutil.which("trtllm-build") is None:
        raise StageError(MISSING_TRTLLM)


def build_environment() -> dict[str, str | None]:
    """What an engine is bound to, found cheaply (no CUDA, no tensorrt_llm import): part of the engine stage's
    fingerprint, so a new GPU or TensorRT-LLM version rebuilds the engine instead of skipping the stage."""
    try:
        version: str | None = importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        query = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]
        gpus: str | None = subprocess.run(query, capture_output=True, text=True, timeout=30, check=False).stdout.strip()  # noqa: S603
    except (OSError, subprocess.SubprocessError):
        gpus = None
    return {"tensorrt_llm": version, "gpus": gpus}


def convert_command(options: TrtllmOptions, hf_dir: Path, checkpoint_dir: Path, python: str = sys.executable) -> list[str]:
    cmd = [
        python, "-m", "cosyvoice_build.trtllm_convert",
        "--model_dir", str(hf_dir),
        "--output_dir", str(checkpoint_dir),
        "--dtype", options.dtype,
        "--tp_size", str(options.tp_size),
    ]  # fmt: skip
    if options.weight_only != "none":
        cmd += ["--use_weight_only", "--weight_only_precision", options.weight_only]
    return cmd


def build_command(options: TrtllmOptions, checkpoint_dir: Path, engine_dir: Path) -> list[str]:
    return [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(engine_dir),
        "--max_batch_size", str(options.max_batch_size),
        "--max_num_tokens", str(options.max_num_tokens),
        "--max_input_len", str(options.max_input_len),
        "--max_seq_len", str(options.max_seq_len),
        "--gemm_plugin", options.dtype,
        "--gpt_attention_plugin", options.dtype,
        "--paged_kv_cache", "enable",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable",
        # fp32 logits: the per-request logits bias (text mask + llm_decoder.bias, see hf_llm) is added in fp32.
        "--logits_dtype", "float32",
        "--workers", str(options.tp_size),
    ]  # fmt: skip


def check_tensor_parallel(options: TrtllmOptions, hf_dir: Path) -> None:
    """TP splits attention heads across GPUs; Qwen2-0.5B has 14 query heads, so only some sizes work."""
    config = json.loads((hf_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    if heads % options.tp_size:
        raise StageError(f"tp_size {options.tp_size} does not divide the model's {heads} attention heads")


def run_command(cmd: list[str], log_path: Path) -> None:
    """Run one tool, its output appended to ``log_path`` and echoed to our log (console: with ``-v``).

    Engine builds take minutes and their length is unknown in advance: the bar counts output lines and time.
    """
    log.info("$ %s", " ".join(cmd))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as sink, tqdm(desc=Path(cmd[0]).name, unit=" lines", disable=None) as bar:
        sink.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # noqa: S603
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            log.debug(line.rstrip())
            bar.update()
        rc = proc.wait()
    if rc != 0:
        raise StageError(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited with {rc}; see {log_path}")


def build_engine(settings: BuildSettings, source_fingerprint: str) -> Path:
    """The whole stage; returns the engine directory."""
    require_tensorrt_llm()
    options, hf_dir = settings.trtllm, settings.hf_llm_dir
    check_tensor_parallel(options, hf_dir)
    commands = [
        convert_command(options, hf_dir, settings.trtllm_checkpoint_dir),
        build_command(options, settings.trtllm_checkpoint_dir, settings.engine_dir),
    ]
    shutil.rmtree(settings.engine_dir, ignore_errors=True)
    for cmd in commands:
        run_command(cmd, settings.state_dir / "logs" / "engine.log")
    meta = BuildMeta(
        built_with=RuntimeInfo.detect(),
        options=asdict(options),
        source_fingerprint=source_fingerprint,
        vocab_layout=json.loads((hf_dir / LAYOUT_FILE).read_text()),
        commands=commands,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    write_build_meta(settings.engine_dir, meta)
    return settings.engine_dir
