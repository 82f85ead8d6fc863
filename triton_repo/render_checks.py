"""Every render option and input checked before anything is written: the bounds and choices the options'
fields declare (`field_errors`), what the options mean together, and the model, engine and DiT directories they
name. `check_options` raises one RenderError naming every problem."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cosyvoice2.config import EngineConfig
from cosyvoice2.dit.config import DiTFlowConfig
from cosyvoice2.dit.layout import DIT_FLOW_CONFIG
from cosyvoice2.dit.loading import check_dit_dir
from cosyvoice2.layout import MODEL_FILES
from triton_repo import cosyvoice3_render, spark_render
import pipeline_contract as contract
from triton_repo.render_options import SCALABLE, TOKEN2WAVS, RenderError, RenderOptions, flag_of
from triton_repo.render_trtllm import TrtllmFlags, trtllm_input_errors


def field_errors(opts: object, prefix: str = "") -> list[str]:
    """The choices and lower bounds the fields of `opts` declare (`render_options.option`); None passes."""
    errors = []
    for f in dataclasses.fields(opts):  # type: ignore[arg-type]
        value, choices, minimum = getattr(opts, f.name), f.metadata.get("choices"), f.metadata.get("minimum")
        if value is None:
            continue
        if choices is not None and value not in choices:
            errors.append(f"{flag_of(f, prefix)} must be one of {', '.join(choices)}, got {value!r}")
        if minimum is not None and not value >= minimum:
            errors.append(f"{flag_of(f, prefix)} must be >= {minimum}, got {value}")
    return errors


def check_options(opts: RenderOptions) -> None:
    """Every option and input, before anything is written; raises RenderError naming every problem."""
    errors = field_errors(opts)
    if not opts.model_dir.is_dir():
        errors.append(f"--model-dir {opts.model_dir} is not a directory (expected an official CosyVoice2 model dir)")
    else:
        missing = [name for name in MODEL_FILES if not (opts.model_dir / name).exists()]
        if missing:
            errors.append(f"--model-dir {opts.model_dir} lacks {', '.join(missing)}")
    if opts.device == "cpu" and opts.dtype != "fp32":
        errors.append(f"--dtype {opts.dtype} needs --device cuda (CPU runs fp32)")
    if opts.layout == "colocated" and opts.llm_backend == "tensorrt_llm":
        errors.append(
            "--layout colocated needs --llm-backend pytorch: TensorRT-LLM runs inside tritonserver itself, so it "
            "cannot share the token2wav process (use --layout single)"
        )
    if opts.llm_yield != "off" and opts.layout != "colocated":
        errors.append(f"--llm-yield {opts.llm_yield} needs --layout colocated (the LLM and token2wav in one process)")
    if opts.layout == "colocated" and opts.instances_of(contract.STREAMING_MODEL) != 1:
        errors.append(f"--layout colocated: {contract.STREAMING_MODEL} holds the engine (the LLM sequences and "
                      f"token2wav streams live in it), one instance (got --instances "
                      f"{contract.STREAMING_MODEL}={opts.instances_of(contract.STREAMING_MODEL)})")
    if opts.llm_delivery == "chunk" and opts.llm_backend == "tensorrt_llm":
        errors.append("--llm-delivery chunk needs --llm-backend pytorch: TensorRT-LLM streams one response per token")
    if opts.token2wav == "dit":
        if opts.dit_dir is None:
            errors.append("--token2wav dit needs --dit-dir (the released token2wav/ directory of Step-Audio-2-mini)")
        else:
            try:
                check_dit_dir(opts.dit_dir)
            except FileNotFoundError as exc:
                errors.append(f"--dit-dir: {exc}")
            else:
                errors += _dit_fit_errors(opts.model_dir, opts.dit_dir)
    elif opts.dit_dir is not None and opts.token2wav in TOKEN2WAVS:
        errors.append("--dit-dir is only used with --token2wav dit")
    if not opts.repetition_penalty > 0:
        errors.append(f"--repetition-penalty must be > 0 (1 = off), got {opts.repetition_penalty}")
    if opts.benchmark_speech_ratio is not None and not opts.benchmark_speech_ratio > 0:
        errors.append(f"--benchmark-speech-ratio must be > 0, got {opts.benchmark_speech_ratio}")
    for model, count in opts.instances.items():
        if model not in SCALABLE:
            errors.append(
                f"--instances {model}={count}: only {', '.join(SCALABLE)} may have several instances "
                "(llm, token2wav and the engines hold per-request state in their process)"
            )
        elif count < 1:
            errors.append(f"--instances {model}={count}: the count must be >= 1")
    if opts.llm_backend == "tensorrt_llm":
        errors += trtllm_input_errors(opts, opts.engine_dir, opts.llm_dir, TrtllmFlags())
    if opts.spark is not None:
        errors += field_errors(opts.spark, opts.spark.FLAG_PREFIX) + spark_render.check(opts)
    if opts.cosyvoice3 is not None:
        errors += field_errors(opts.cosyvoice3, opts.cosyvoice3.FLAG_PREFIX) + cosyvoice3_render.check(opts)
    if errors:
        raise RenderError("cannot render the Triton repository:\n  - " + "\n  - ".join(errors))


def _dit_fit_errors(model_dir: Path, dit_dir: Path) -> list[str]:
    """The DiT flow must take every speech token the LLM can emit, and the lookahead the orchestrators' chunks
    carry (CosyVoice2's schedule drives the DiT streams)."""
    try:
        dit = DiTFlowConfig.from_flow_yaml(dit_dir / DIT_FLOW_CONFIG)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:  # a malformed yaml, any shape
        return [f"--dit-dir: {dit_dir / DIT_FLOW_CONFIG} is not a DiT flow config ({exc})"]
    if not model_dir.is_dir():
        return []  # reported above
    engine = EngineConfig.for_model_dir(model_dir)
    errors = []
    if dit.vocab_size < engine.llm.speech_token_size:
        errors.append(f"--dit-dir: the DiT flow knows {dit.vocab_size} speech tokens, the LLM emits "
                      f"{engine.llm.speech_token_size}")
    if dit.pre_lookahead_len != engine.flow.pre_lookahead_len:
        errors.append(f"--dit-dir: the DiT flow's lookahead is {dit.pre_lookahead_len} tokens, the chunk schedule "
                      f"sends {engine.flow.pre_lookahead_len}")
    return errors
