"""``cosyvoice-build`` / ``python -m cosyvoice_build``: run the build stages (all, or ``--from``/``--to``).

Every option also reads ``COSYVOICE_<OPTION>`` from the environment (docker-compose sets those).
Exit status 0 when every selected stage is done or up to date, 1 when one failed (the others still ran).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import get_args

from cosyvoice_build.pipeline import run_stages
from cosyvoice_build.settings import (
    COSYVOICE3_MODEL_ID,
    SPARK_MODEL_ID,
    BuildSettings,
    CosyVoice3Source,
    DitSource,
    LLMBackend,
    ModelSource,
    SparkSource,
    Token2WavKind,
    TritonLayout,
    TrtllmOptions,
)
from cosyvoice_build.stages import STAGES

ENV_PREFIX = "COSYVOICE_"
_DEFAULTS = BuildSettings(model_source="hf")
_TRT_DEFAULTS = TrtllmOptions()


def _env(option: str, default: object) -> object:
    """``COSYVOICE_<OPTION>``; empty counts as unset (compose passes ``${VAR:-}`` as an empty string)."""
    return os.environ.get(ENV_PREFIX + option.upper().replace("-", "_")) or default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cosyvoice-build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [s.name for s in STAGES]

    def opt(name: str, default: object, **kwargs: object) -> None:
        p.add_argument(f"--{name}", default=_env(name, default), **kwargs)  # type: ignore[arg-type]

    p.add_argument("--from", dest="first", choices=names, help="first stage to run (default: the first)")
    p.add_argument("--to", dest="last", choices=names, help="last stage to run (default: the last)")
    p.add_argument("--force", action="store_true", help="re-run selected stages even if up to date")
    p.add_argument("--list", action="store_true", help="list the stages and exit")
    opt("work-dir", _DEFAULTS.work_dir, type=Path, help="where weights, checkpoints, engines and the repository go")
    opt("model-source", _DEFAULTS.model_source, choices=get_args(ModelSource))
    opt("model-id", None, help="hub repository (default: FunAudioLLM/CosyVoice2-0.5B, ModelScope iic/CosyVoice2-0.5B)")
    opt("model-revision", None)
    opt("model-dir", None, type=Path, help="existing weights directory (model source 'local')")
    opt("llm-backend", _DEFAULTS.llm_backend, choices=get_args(LLMBackend))
    opt("triton-layout", _DEFAULTS.triton_layout, choices=get_args(TritonLayout))
    opt("hf-dtype", _DEFAULTS.hf_dtype, choices=["float32", "bfloat16", "float16"])
    opt("triton-device", None, choices=["cpu", "cuda"], help="device of the PyTorch models in Triton (default: render's)")
    opt("triton-dtype", None, choices=["fp32", "fp16", "bf16"], help="their precision (default: render's, fp32)")
    opt("trt-dtype", _TRT_DEFAULTS.dtype, choices=["bfloat16", "float16"])
    opt("trt-weight-only", _TRT_DEFAULTS.weight_only, choices=["none", "int8", "int4"])
    for name in ("tp_size", "max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len"):
        opt("trt-" + name.replace("_", "-"), getattr(_TRT_DEFAULTS, name), type=int)
    opt("token2wav", _DEFAULTS.token2wav, choices=get_args(Token2WavKind),
        help="unet: CosyVoice2's flow; dit: Step-Audio-2-mini's DiT flow (its token2wav/ files are fetched too)")
    opt("dit-source", _DEFAULTS.dit_source, choices=get_args(DitSource))
    opt("dit-model-id", _DEFAULTS.dit_model_id, help="hub repository holding token2wav/")
    opt("dit-revision", None)
    opt("dit-dir", None, type=Path, help="existing token2wav/ directory (DiT source 'local')")
    opt("smoke-text", _DEFAULTS.smoke_text)
    opt("smoke-url", None, help="gRPC host:port of a running Triton for the smoke test (default: start one)")
    opt("spark-source", "off", choices=get_args(SparkSource),
        help="Spark-TTS weights (CC-BY-NC-SA-4.0): off (default, never fetched), hf, or local")
    opt("spark-model-id", SPARK_MODEL_ID)
    opt("spark-revision", None)
    opt("spark-model-dir", None, type=Path, help="existing Spark weights directory (spark source 'local')")
    p.add_argument("--accept-spark-license", action="store_true",
                   default=str(_env("accept-spark-license", "")).lower() in ("1", "true", "yes"),
                   help="agree to the Spark-TTS weights' non-commercial licence (needed to download them)")
    opt("cosyvoice3-source", "off", choices=get_args(CosyVoice3Source),
        help="Fun-CosyVoice3-0.5B-2512 weights: off (default, never fetched), hf, modelscope, or local")
    opt("cosyvoice3-model-id", COSYVOICE3_MODEL_ID, help="hub repository (the same name on both hubs)")
    opt("cosyvoice3-revision", None)
    opt("cosyvoice3-model-dir", None, type=Path, help="existing CosyVoice3 weights directory (cosyvoice3 source 'local')")
    p.add_argument("-v", "--verbose", action="store_true", help="also echo tool output (trtllm-build) to the console")
    return p


def settings_from_args(args: argparse.Namespace) -> BuildSettings:
    trt = TrtllmOptions(
        dtype=args.trt_dtype,
        weight_only=args.trt_weight_only,
        **{n: int(getattr(args, "trt_" + n)) for n in ("tp_size", "max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len")},
    )
    return BuildSettings(
        work_dir=Path(args.work_dir),
        model_source=args.model_source,
        model_id=args.model_id,
        model_revision=args.model_revision,
        model_dir=Path(args.model_dir) if args.model_dir else None,
        llm_backend=args.llm_backend,
        triton_layout=args.triton_layout,
        hf_dtype=args.hf_dtype,
        triton_device=args.triton_device,
        triton_dtype=args.triton_dtype,
        trtllm=trt,
        smoke_text=args.smoke_text,
        smoke_url=args.smoke_url,
        token2wav=args.token2wav,
        dit_source=args.dit_source,
        dit_model_id=args.dit_model_id,
        dit_revision=args.dit_revision,
        dit_local_dir=Path(args.dit_dir) if args.dit_dir else None,
        spark_source=args.spark_source,
        spark_model_id=args.spark_model_id,
        spark_revision=args.spark_revision,
        spark_model_dir=Path(args.spark_model_dir) if args.spark_model_dir else None,
        accept_spark_license=bool(args.accept_spark_license),
        cosyvoice3_source=args.cosyvoice3_source,
        cosyvoice3_model_id=args.cosyvoice3_model_id,
        cosyvoice3_revision=args.cosyvoice3_revision,
        cosyvoice3_model_dir=Path(args.cosyvoice3_model_dir) if args.cosyvoice3_model_dir else None,
    )


def _setup_logging(log_file: Path, verbose: bool) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.DEBUG if verbose else logging.INFO)
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setLevel(logging.DEBUG)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    for handler in (console, to_file):
        handler.setFormatter(fmt)
    logger = logging.getLogger("cosyvoice_build")
    logger.handlers[:] = [console, to_file]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        width = max(len(stage.name) for stage in STAGES)
        for stage in STAGES:
            print(f"{stage.name:{width}s}  {stage.description}")
        return 0
    for action in parser._actions:  # argparse checks choices on the command line only, not on env defaults
        if action.choices is not None and action.dest not in ("first", "last"):
            value = getattr(args, action.dest)
            if value is not None and value not in action.choices:
                parser.error(f"{action.dest} {value!r} is not one of {sorted(action.choices)}")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    _setup_logging(settings.state_dir / "logs" / "build.log", args.verbose)
    results = run_stages(STAGES, settings, args.first, args.last, args.force)
    log = logging.getLogger("cosyvoice_build")
    for result in results:
        log.info("%-9s %s%s", result.stage, result.outcome, f": {result.detail}" if result.detail else "")
    return 1 if any(r.outcome == "failed" for r in results) else 0
