"""Fetch the Fun-CosyVoice3-0.5B-2512 weights (engine ``cosyvoice3/``) - only when asked - and verify them.

Nothing is downloaded by default: the ``cosyvoice3-weights`` stage does nothing unless a source is chosen
(``--cosyvoice3-source hf|modelscope|local``), so CosyVoice2 builds are unchanged. A download goes through the
same hub clients as CosyVoice2's weights (same messages when the client is missing or the hub unreachable, same
resume and clean-up), and takes only ``cosyvoice3.layout.RELEASED_FILES``. Verification is torch-free: every
released file present and well-formed (naming each one that is not), and ``cosyvoice3.yaml`` with
``CosyVoice-BlankEN/config.json`` parse as a CosyVoice3 model. A local directory is only verified.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from cosyvoice_build.pipeline import StageError
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.weights import HUB_DOWNLOADS, HubDownload, download_into

from cosyvoice3 import layout
from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.errors import CosyVoice3ConfigError

log = logging.getLogger("cosyvoice_build")

DOWNLOAD_PATTERNS = layout.RELEASED_FILES


def verify_cosyvoice3_dir(model_dir: Path) -> None:
    """Raise StageError naming every missing or malformed file of a CosyVoice3 model directory."""
    if not model_dir.is_dir():
        raise StageError(f"CosyVoice3 model directory {model_dir} does not exist")
    problems = layout.released_dir_problems(model_dir)
    if not problems:  # the files are there and well-formed: do they describe the model our engine implements?
        try:
            CosyVoice3Config.from_model_dir(model_dir)
        except (CosyVoice3ConfigError, KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
            problems.append(f"{layout.MODEL_YAML} with {layout.QWEN_CONFIG}: not a CosyVoice3 model ({exc})")
    if problems:
        raise StageError(f"CosyVoice3 model directory {model_dir} is incomplete: " + "; ".join(problems))


def fetch_cosyvoice3_weights(settings: BuildSettings, hubs: dict[str, HubDownload] | None = None) -> Path | None:
    """Make ``settings.cosyvoice3_weights_dir`` hold verified weights and return it; None when not requested.
    ``hubs`` replaces the downloaders (tests)."""
    if settings.cosyvoice3_source == "off":
        log.info("[cosyvoice3-weights] not requested (--cosyvoice3-source hf|modelscope|local)")
        return None
    target = settings.cosyvoice3_weights_dir
    if settings.cosyvoice3_source != "local":
        download = (hubs or HUB_DOWNLOADS)[settings.cosyvoice3_source]
        download_into(download, settings.cosyvoice3_model_id, settings.cosyvoice3_revision, target, DOWNLOAD_PATTERNS)
    verify_cosyvoice3_dir(target)
    return target
