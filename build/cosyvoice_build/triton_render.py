"""The one place that calls the Triton repository render tool of ``triton_repo`` (owned by that package).

Interface: ``triton_repo.render.render_repository`` with keyword arguments ``output_dir``, ``model_dir``
(CosyVoice2 weights), ``llm_backend`` ("trtllm" | "torch"), ``llm_dir`` (our HF checkpoint: logits bias,
vocabulary layout), ``engine_dir`` (TensorRT-LLM engine; None for the torch backend), ``layout`` ("single" |
"colocated") and render options: ``device``, ``dtype``, ``token2wav``/``dit_dir`` (the DiT
token2wav), and for TensorRT-LLM the engine's ``max_batch``/``max_seq_len`` (the KV cache is sized from them).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings

RENDER_MODULE = "triton_repo.render"
RENDER_FUNCTION = "render_repository"


def render_arguments(settings: BuildSettings) -> dict[str, object]:
    trtllm = settings.llm_backend == "trtllm"
    arguments: dict[str, object] = {
        "output_dir": settings.triton_repo_dir,
        "model_dir": settings.weights_dir,
        "llm_backend": settings.llm_backend,
        "llm_dir": settings.hf_llm_dir if trtllm else None,
        "engine_dir": settings.engine_dir if trtllm else None,
        "layout": settings.triton_layout,
    }
    if trtllm:  # serve exactly the shapes the engine was built for
        arguments.update(max_batch=settings.trtllm.max_batch_size, max_seq_len=settings.trtllm.max_seq_len)
    if settings.token2wav == "dit":  # the token2wav/ files the download stage fetched and verified
        arguments.update(token2wav="dit", dit_dir=settings.dit_dir)
    if settings.triton_device is not None:
        arguments["device"] = settings.triton_device
    if settings.triton_dtype is not None:
        arguments["dtype"] = settings.triton_dtype
    return arguments


def render_triton_repository(settings: BuildSettings) -> Path:
    try:
        module = importlib.import_module(RENDER_MODULE)
    except ModuleNotFoundError as exc:
        raise StageError(f"render tool missing: {RENDER_MODULE} is not importable ({exc})") from exc
    render = getattr(module, RENDER_FUNCTION, None)
    if render is None:
        raise StageError(f"render tool missing: {RENDER_MODULE} has no {RENDER_FUNCTION}()")
    arguments = render_arguments(settings)
    try:
        inspect.signature(render).bind(**arguments)
    except TypeError as exc:
        raise StageError(f"{RENDER_MODULE}.{RENDER_FUNCTION} does not take {sorted(arguments)}: {exc}") from exc
    try:
        render(**arguments)
    except (ValueError, TypeError) as exc:  # RenderError (a ValueError) names each refused option or input
        raise StageError(str(exc)) from exc
    return settings.triton_repo_dir
