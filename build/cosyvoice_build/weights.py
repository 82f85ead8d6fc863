"""Fetch the CosyVoice2-0.5B weights (Hugging Face hub, ModelScope, or a local directory) and verify them."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Callable, Protocol

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings

from cosyvoice2.layout import CHECKPOINT_FILES as TORCH_CHECKPOINTS
from cosyvoice2.layout import ONNX_FILES as ONNX_MODELS
from cosyvoice2.layout import TOKENIZER_SUBDIR as TOKENIZER_DIR

JSON_FILES = (f"{TOKENIZER_DIR}/config.json", f"{TOKENIZER_DIR}/vocab.json", f"{TOKENIZER_DIR}/tokenizer_config.json")
TEXT_FILES = (f"{TOKENIZER_DIR}/merges.txt",)
REQUIRED_FILES = TORCH_CHECKPOINTS + ONNX_MODELS + JSON_FILES + TEXT_FILES
#: Only what is needed is downloaded: the repository also holds ~1.5 GB we never read (flow.cache.pt,
#: TorchScript/ONNX exports of the flow, BlankEN's model.safetensors whose weights llm.pt replaces).
DOWNLOAD_PATTERNS = (*REQUIRED_FILES, "cosyvoice2.yaml", f"{TOKENIZER_DIR}/generation_config.json")


class HubDownload(Protocol):
    def __call__(self, repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None: ...


def verify_model_dir(model_dir: Path) -> None:
    """Raise StageError naming every missing or malformed file the engine needs."""
    if not model_dir.is_dir():
        raise StageError(f"model directory {model_dir} does not exist")
    problems = []
    for name in REQUIRED_FILES:
        path = model_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size == 0:
            problems.append(f"{name}: empty")
        elif name in TORCH_CHECKPOINTS and not zipfile.is_zipfile(path):
            problems.append(f"{name}: not a torch.save archive (truncated download?)")
        elif name in JSON_FILES:
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problems.append(f"{name}: invalid JSON ({exc})")
    if problems:
        raise StageError(f"model directory {model_dir} is incomplete: " + "; ".join(problems))


def huggingface_download(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only needed for this source
    except ImportError as exc:
        raise StageError("huggingface_hub is not installed: pip install huggingface_hub") from exc
    try:
        snapshot_download(repo_id=repo_id, revision=revision, local_dir=str(local_dir), allow_patterns=allow_patterns)
    except Exception as exc:  # network, auth and not-found errors all end the stage the same way
        raise StageError(f"download of {repo_id} from the Hugging Face hub failed: {exc}") from exc


def modelscope_download(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
    try:
        from modelscope import snapshot_download  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise StageError(
            "the ModelScope source needs the modelscope package: pip install modelscope "
            "(or use --model-source hf, or a local directory)"
        ) from exc
    try:
        snapshot_download(repo_id, revision=revision, local_dir=str(local_dir), allow_patterns=allow_patterns)
    except Exception as exc:
        raise StageError(f"download of {repo_id} from ModelScope failed: {exc}") from exc


HUB_DOWNLOADS: dict[str, HubDownload] = {"hf": huggingface_download, "modelscope": modelscope_download}


def fetch_weights(settings: BuildSettings, hubs: dict[str, HubDownload] | None = None) -> Path:
    """Make ``settings.weights_dir`` hold verified weights; return it. ``hubs`` replaces the downloaders (tests)."""
    if settings.model_source != "local":
        download: Callable[..., None] = (hubs or HUB_DOWNLOADS)[settings.model_source]
        settings.weights_dir.mkdir(parents=True, exist_ok=True)
        download(settings.resolved_model_id, settings.model_revision, settings.weights_dir, list(DOWNLOAD_PATTERNS))
    verify_model_dir(settings.weights_dir)
    return settings.weights_dir
