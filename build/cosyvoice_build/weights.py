"""Fetch the CosyVoice2-0.5B weights (Hugging Face hub, ModelScope, or a local directory) and verify them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings

from cosyvoice2.layout import REQUIRED_FILES, model_dir_problems
from cosyvoice2.layout import TOKENIZER_SUBDIR as TOKENIZER_DIR
#: Only what is needed is downloaded: the repository also holds ~1.5 GB we never read (flow.cache.pt,
#: TorchScript/ONNX exports of the flow, BlankEN's model.safetensors whose weights llm.pt replaces).
DOWNLOAD_PATTERNS = (*REQUIRED_FILES, "cosyvoice2.yaml", f"{TOKENIZER_DIR}/generation_config.json")


class HubDownload(Protocol):
    def __call__(self, repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None: ...


def verify_model_dir(model_dir: Path) -> None:
    """Raise StageError naming every missing or malformed file the engine needs."""
    if not model_dir.is_dir():
        raise StageError(f"model directory {model_dir} does not exist")
    problems = model_dir_problems(model_dir)
    if problems:
        raise StageError(f"model directory {model_dir} is incomplete: " + "; ".join(problems))


def huggingface_download(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - only needed for this source
        from huggingface_hub.utils import LocalEntryNotFoundError  # noqa: PLC0415
    except ImportError as exc:
        raise StageError("huggingface_hub is not installed: pip install huggingface_hub") from exc
    try:
        snapshot_download(repo_id=repo_id, revision=revision, local_dir=str(local_dir), allow_patterns=allow_patterns)
    except LocalEntryNotFoundError as exc:
        # The client raises this when it cannot reach the hub (no network, HF_HUB_OFFLINE set) and finds nothing
        # to fall back on: say so in words, with the two ways forward, before the client's own text.
        raise StageError(
            f"cannot reach the Hugging Face hub to download {repo_id} (no network, or HF_HUB_OFFLINE is set) and "
            f"{local_dir} holds no earlier download of it: download it on a machine that reaches the hub and copy "
            f"the directory to {local_dir} (the next run verifies it), or use an existing copy as the local "
            f"source. ({exc})"
        ) from exc
    except Exception as exc:  # network, auth and not-found errors all end the stage the same way
        raise StageError(f"download of {repo_id} from the Hugging Face hub failed: {exc}") from exc


def modelscope_download(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
    try:
        from modelscope import snapshot_download  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise StageError(
            "the ModelScope source needs the modelscope package: pip install modelscope "
            "(or use the hf source, or a local directory)"
        ) from exc
    try:
        snapshot_download(repo_id, revision=revision, local_dir=str(local_dir), allow_patterns=allow_patterns)
    except Exception as exc:
        raise StageError(f"download of {repo_id} from ModelScope failed: {exc}") from exc


HUB_DOWNLOADS: dict[str, HubDownload] = {"hf": huggingface_download, "modelscope": modelscope_download}


def download_into(download: HubDownload, repo_id: str, revision: str | None, target: Path,
                  patterns: tuple[str, ...]) -> None:
    """Fetch ``patterns`` of ``repo_id`` into ``target``, the way every model directory of the build is fetched.

    A failed first download (no network, wrong id) must not leave an empty directory behind: the local stack would
    take it for a user's directory. Partly downloaded files stay (the hub client resumes them next time), and a
    directory that existed before is never removed."""
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    try:
        download(repo_id, revision, target, list(patterns))
    except BaseException:
        if created and not any(path.is_file() for path in target.rglob("*")):
            shutil.rmtree(target, ignore_errors=True)
        raise


def fetch_weights(settings: BuildSettings, hubs: dict[str, HubDownload] | None = None) -> Path:
    """Make ``settings.weights_dir`` hold verified weights; return it. ``hubs`` replaces the downloaders (tests)."""
    if settings.model_source != "local":
        download: HubDownload = (hubs or HUB_DOWNLOADS)[settings.model_source]
        download_into(download, settings.resolved_model_id, settings.model_revision, settings.weights_dir,
                      DOWNLOAD_PATTERNS)
    verify_model_dir(settings.weights_dir)
    return settings.weights_dir
