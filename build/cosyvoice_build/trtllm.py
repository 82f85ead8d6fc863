"""The TensorRT-LLM engine stage: HF checkpoint -> TRT-LLM checkpoint -> engine, plus build_meta.json.

Two commands, both logged and run as subprocesses:

1. ``python -m cosyvoice_build.trtllm_convert`` (our wrapper of TRT-LLM's ``QWenForCausalLM.from_hugging_face``,
   with the flags of TRT-LLM's Qwen ``convert_checkpoint.py`` example; the example's path differs between images);
2. ``trtllm-build`` with explicit shapes and plugins.

TensorRT-LLM exists only as NVIDIA's GPU wheels/images, so when it is not importable the stage stops at once and
says where to run it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from collections.abc import Callable
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


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: TrtllmOptions, seq_len_help: str) -> None:
    """The engine flags of the stand-alone engine builders (Spark's, CosyVoice3's): precision, parallelism, shapes,
    and --print (write the commands instead of running them)."""
    parser.add_argument("--work-dir", type=Path, default=Path("models"), help="trtllm/ goes here (default models)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--weight-only", choices=("none", "int8", "int4"), default=defaults.weight_only)
    parser.add_argument("--tp-size", type=int, default=defaults.tp_size)
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                        help="sequences decoded together (the render's --max-batch may not exceed it)")
    parser.add_argument("--max-input-len", type=int, default=defaults.max_input_len, help=seq_len_help)
    parser.add_argument("--print", action="store_true", help="print the commands instead of running them")


def run_engine_tool(tool: str, prepare: Callable[[], Path], options: TrtllmOptions, steps: list[list[str]],
                    print_only: bool, render_flags: str) -> int:
    """The stand-alone engine builders' run (Spark's, CosyVoice3's): `prepare` checks the inputs and returns the
    Hugging Face checkpoint the `steps` (convert, build) read; then the commands are printed (`print_only`) or run
    where TensorRT-LLM is installed, logged beside the engine. Returns the exit status; errors go to stderr."""
    engine = Path(steps[1][steps[1].index("--output_dir") + 1])
    try:
        check_tensor_parallel(options, prepare())
        if print_only:
            print("\n".join(shlex.join(cmd) for cmd in steps))
            return 0
        require_tensorrt_llm()
        for cmd in steps:
            run_command(cmd, engine.parent / f"{engine.name}.log")
    except StageError as exc:
        print(f"{tool}: {exc}", file=sys.stderr)
        return 1
    print(f"engine: {engine} (render {render_flags.format(engine=engine)})")
    return 0
