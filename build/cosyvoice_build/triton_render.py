"""The one place that calls the Triton repository render tool of ``triton_repo`` (owned by that package).

Assumed interface (adjust here, and only here, if the tool differs): ``triton_repo.render.render_repository``
called with keyword arguments ``output_dir``, ``model_dir`` (CosyVoice2 weights), ``llm_backend``
("trtllm" | "torch"), ``llm_dir`` (our HF checkpoint: tokenizer, logits bias, vocabulary layout), ``engine_dir``
(TensorRT-LLM engine, None for the torch backend) and ``layout`` ("single" | "disaggregated"); it writes the
repository into ``output_dir``.
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
    return {
        "output_dir": settings.triton_repo_dir,
        "model_dir": settings.weights_dir,
        "llm_backend": settings.llm_backend,
        "llm_dir": settings.hf_llm_dir,
        "engine_dir": settings.engine_dir if settings.llm_backend == "trtllm" else None,
        "layout": settings.triton_layout,
    }


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
    render(**arguments)
    return settings.triton_repo_dir
