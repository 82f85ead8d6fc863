"""Fetch the DiT token2wav files (Step-Audio-2-mini `token2wav/` only) and verify them.

Only the five files of the `token2wav/` folder are downloaded (about 1.2 GB); the rest of the repository (the
Step-Audio 2 LLM, ~18 GB) is never touched. Verification is torch-free: every file present and non-empty, the
checkpoints are torch.save archives, `flow.yaml` describes a DiT flow this engine implements.
"""

from __future__ import annotations

from pathlib import Path

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.weights import HUB_DOWNLOADS, HubDownload

from cosyvoice2.dit.config import DiTConfigError, DiTFlowConfig
from cosyvoice2.dit.layout import DIT_FLOW_CONFIG, DIT_FLOW_FILE, DIT_HF_SUBFOLDER, DIT_HIFT_FILE, DIT_RELEASED_FILES
from cosyvoice2.layout import file_problem

DIT_DOWNLOAD_PATTERNS = tuple(f"{DIT_HF_SUBFOLDER}/{name}" for name in DIT_RELEASED_FILES)
_CHECKPOINTS = (DIT_FLOW_FILE, DIT_HIFT_FILE)


def verify_dit_dir(directory: Path) -> None:
    """Raise StageError naming every missing or malformed file of a DiT token2wav directory."""
    if not directory.is_dir():
        raise StageError(f"DiT token2wav directory {directory} does not exist")
    problems = []
    for name in DIT_RELEASED_FILES:
        path = directory / name
        problem = file_problem(path, checkpoint=name in _CHECKPOINTS)
        if problem:
            problems.append(f"{name}: {problem}")
        elif name == DIT_FLOW_CONFIG:
            try:
                DiTFlowConfig.from_flow_yaml(path)
            except (DiTConfigError, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{name}: not a DiT token2wav flow.yaml ({exc})")
    if problems:
        raise StageError(f"DiT token2wav directory {directory} is incomplete: " + "; ".join(problems))


def fetch_dit_token2wav(settings: BuildSettings, hubs: dict[str, HubDownload] | None = None) -> Path:
    """Make ``settings.dit_dir`` hold verified DiT token2wav files; return it. ``hubs`` replaces the downloaders
    (tests). A local directory (``--dit-dir``) is only verified."""
    if settings.dit_source != "local":
        download = (hubs or HUB_DOWNLOADS)[settings.dit_source]
        root = settings.dit_dir.parent  # the hub keeps the folder: <root>/token2wav/...
        root.mkdir(parents=True, exist_ok=True)
        download(settings.dit_model_id, settings.dit_revision, root, list(DIT_DOWNLOAD_PATTERNS))
    verify_dit_dir(settings.dit_dir)
    return settings.dit_dir
