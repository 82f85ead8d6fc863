"""The build stages, in order: download -> convert -> engine -> render -> smoke.

Each stage is wiring only: what it reads, what it writes, which module does the work. ``convert`` and ``engine``
serve the TensorRT-LLM backend; with the PyTorch backend they have nothing to do (our engine reads llm.pt).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from cosyvoice_build import (
    cosyvoice3_weights, dit_weights, smoke, spark_weights, trtllm, triton_render, vocab_layout, weights,
)  # fmt: skip
from cosyvoice_build.engine_meta import BUILD_META_FILE
from cosyvoice_build.fingerprint import DigestCache, fingerprint
from cosyvoice_build.pipeline import Stage, StageError, StageInputs
from cosyvoice_build.settings import BuildSettings

log = logging.getLogger("cosyvoice_build")

#: Bump when the HF conversion's output changes, so existing checkpoints are rebuilt.
CONVERTER_VERSION = 1


def _uses_trtllm(settings: BuildSettings) -> bool:
    return settings.llm_backend == "trtllm"


# download ------------------------------------------------------------------------------------------------
def _uses_dit(settings: BuildSettings) -> bool:
    return settings.token2wav == "dit"


def _download_inputs(settings: BuildSettings) -> StageInputs:
    values: dict[str, object] = {
        "source": settings.model_source,
        "model": str(settings.model_dir) if settings.model_source == "local" else settings.resolved_model_id,
        "revision": settings.model_revision,
        "patterns": list(weights.DOWNLOAD_PATTERNS),
    }
    if _uses_dit(settings):
        values["dit"] = {"source": settings.dit_source, "dir": str(settings.dit_dir), "model": settings.dit_model_id,
                         "revision": settings.dit_revision, "patterns": list(dit_weights.DIT_DOWNLOAD_PATTERNS)}
    return StageInputs(values=values)


def _download_outputs(settings: BuildSettings) -> list[Path]:
    return [settings.weights_dir, settings.dit_dir] if _uses_dit(settings) else [settings.weights_dir]


def _download(settings: BuildSettings) -> None:
    weights.fetch_weights(settings)
    if _uses_dit(settings):
        dit_weights.fetch_dit_token2wav(settings)


# convert -------------------------------------------------------------------------------------------------
def _convert_inputs(settings: BuildSettings) -> StageInputs:
    if not _uses_trtllm(settings):
        return StageInputs(values={"backend": settings.llm_backend})
    tokenizer = settings.weights_dir / weights.TOKENIZER_DIR
    files = [settings.weights_dir / "llm.pt"] + [tokenizer / n for n in ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json")]
    return StageInputs(paths=files, values={"dtype": settings.hf_dtype, "converter": CONVERTER_VERSION})


def _convert_outputs(settings: BuildSettings) -> list[Path]:
    if not _uses_trtllm(settings):
        return []
    return [settings.hf_llm_dir / n for n in ("model.safetensors", vocab_layout.LAYOUT_FILE, vocab_layout.LOGITS_BIAS_FILE)]


def _convert(settings: BuildSettings) -> None:
    if not _uses_trtllm(settings):
        log.info("[convert] nothing to do for the %s backend", settings.llm_backend)
        return
    import torch  # noqa: PLC0415 - heavy: only when converting

    from cosyvoice_build import hf_llm  # noqa: PLC0415 - imports torch and transformers

    partial = settings.hf_llm_dir.with_name(settings.hf_llm_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        layout = hf_llm.convert_llm_to_hf(settings.weights_dir, partial, getattr(torch, settings.hf_dtype))
    except hf_llm.ConversionError as exc:
        raise StageError(str(exc)) from exc
    shutil.rmtree(settings.hf_llm_dir, ignore_errors=True)
    partial.rename(settings.hf_llm_dir)  # appears complete or not at all
    log.info("[convert] speech tokens at %d.., end ids %s, vocabulary %d", layout.speech_offset, layout.end_ids, layout.padded_vocab_size)


# engine --------------------------------------------------------------------------------------------------
def _engine_inputs(settings: BuildSettings) -> StageInputs:
    if not _uses_trtllm(settings):
        return StageInputs(values={"backend": settings.llm_backend})
    return StageInputs(paths=[settings.hf_llm_dir], values={**asdict(settings.trtllm), "environment": trtllm.build_environment()})


def _engine_outputs(settings: BuildSettings) -> list[Path]:
    return [settings.engine_dir / BUILD_META_FILE] if _uses_trtllm(settings) else []


def _engine(settings: BuildSettings) -> None:
    if not _uses_trtllm(settings):
        log.info("[engine] nothing to do for the %s backend", settings.llm_backend)
        return
    source = fingerprint([settings.hf_llm_dir], {}, DigestCache(settings.state_dir / "digests.json"))
    trtllm.build_engine(settings, source)


# render --------------------------------------------------------------------------------------------------
def _render_tool_sources() -> list[Path]:
    """The render tool's code (`render.py` and the `render_*.py`/`spark_render.py` modules it is split into) and
    templates: a changed template re-renders the repository."""
    spec = importlib.util.find_spec("triton_repo")
    if spec is None or spec.origin is None:
        return []
    root = Path(spec.origin).parent
    return [p for p in (*sorted(root.glob("*render*.py")), root / "templates") if p.exists()]


def _render_inputs(settings: BuildSettings) -> StageInputs:
    paths = _render_tool_sources()
    if _uses_trtllm(settings):
        paths.append(settings.engine_dir / BUILD_META_FILE)
    return StageInputs(paths=paths, values={k: str(v) for k, v in triton_render.render_arguments(settings).items()})


def _render(settings: BuildSettings) -> None:
    triton_render.render_triton_repository(settings)


# smoke ---------------------------------------------------------------------------------------------------
def _smoke_inputs(settings: BuildSettings) -> StageInputs:
    return StageInputs(paths=[] if settings.smoke_url else [settings.triton_repo_dir])


def _smoke(settings: BuildSettings) -> None:
    smoke.run_smoke_test(settings)


# spark-weights, cosyvoice3-weights: optional models, fetched only when their source is not "off" ------------
def _optional_weights_inputs(model: str, patterns: Sequence[str]) -> Callable[[BuildSettings], StageInputs]:
    """The inputs of `model`'s weights stage, read from its `<model>_source` / `_model_id` / `_model_dir` /
    `_revision` settings."""

    def inputs(settings: BuildSettings) -> StageInputs:
        source = getattr(settings, f"{model}_source")
        local = str(getattr(settings, f"{model}_model_dir")) if source == "local" else None
        return StageInputs(values={
            "source": source,
            "model": local or getattr(settings, f"{model}_model_id"),
            "revision": getattr(settings, f"{model}_revision"),
            "patterns": list(patterns),
        })

    return inputs


def _optional_weights_outputs(model: str) -> Callable[[BuildSettings], list[Path]]:
    def outputs(settings: BuildSettings) -> list[Path]:
        return [] if getattr(settings, f"{model}_source") == "off" else [getattr(settings, f"{model}_weights_dir")]

    return outputs


_spark_inputs = _optional_weights_inputs("spark", spark_weights.DOWNLOAD_PATTERNS)
_spark_outputs = _optional_weights_outputs("spark")
_cosyvoice3_inputs = _optional_weights_inputs("cosyvoice3", cosyvoice3_weights.DOWNLOAD_PATTERNS)
_cosyvoice3_outputs = _optional_weights_outputs("cosyvoice3")


def _spark(settings: BuildSettings) -> None:
    spark_weights.fetch_spark_weights(settings)


def _cosyvoice3(settings: BuildSettings) -> None:
    cosyvoice3_weights.fetch_cosyvoice3_weights(settings)


STAGES: list[Stage] = [
    Stage("download", "fetch and verify the CosyVoice2-0.5B weights (and the DiT token2wav's)", _download_inputs, _download_outputs, _download),
    Stage("convert", "llm.pt + CosyVoice-BlankEN -> HF Qwen2ForCausalLM with the speech vocabulary", _convert_inputs, _convert_outputs, _convert),
    Stage("engine", "HF checkpoint -> TensorRT-LLM checkpoint -> engine + build_meta.json", _engine_inputs, _engine_outputs, _engine),
    Stage("render", "render the Triton model repository", _render_inputs, lambda s: [s.triton_repo_dir], _render),
    Stage("smoke", "synthesize one sentence through the rendered repository", _smoke_inputs, lambda s: [], _smoke, cacheable=False),
    Stage("spark-weights", "only when asked: fetch and verify the Spark-TTS-0.5B weights (CC-BY-NC-SA-4.0)",
          _spark_inputs, _spark_outputs, _spark),
    Stage("cosyvoice3-weights", "only when asked: fetch and verify the Fun-CosyVoice3-0.5B-2512 weights",
          _cosyvoice3_inputs, _cosyvoice3_outputs, _cosyvoice3),
]  # fmt: skip
