"""File names of a CosyVoice2 model directory in the official layout (docs/reference/cosyvoice2.md#model-directory),
and the check of one.

Torch-free, so the render tool, the local stack and the build tooling can check a directory without loading
anything.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
TOKENIZER_SUBDIR = "CosyVoice-BlankEN"

CHECKPOINT_FILES = (LLM_FILE, FLOW_FILE, HIFT_FILE)
ONNX_FILES = (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
#: Everything the engine reads; the tokenizer entry is a directory.
MODEL_FILES = (*CHECKPOINT_FILES, *ONNX_FILES, TOKENIZER_SUBDIR)
#: The files of the tokenizer directory the engine reads (the Qwen2 config and the BPE tokenizer).
TOKENIZER_JSON_FILES = tuple(
    f"{TOKENIZER_SUBDIR}/{name}" for name in ("config.json", "vocab.json", "tokenizer_config.json")
)
TOKENIZER_TEXT_FILES = (f"{TOKENIZER_SUBDIR}/merges.txt",)
#: Every file the engine reads, one path per file.
REQUIRED_FILES = (*CHECKPOINT_FILES, *ONNX_FILES, *TOKENIZER_JSON_FILES, *TOKENIZER_TEXT_FILES)


def file_problem(path: Path, checkpoint: bool = False) -> str | None:
    """What is wrong with one downloaded file (missing, empty, or - for a checkpoint - not a torch.save zip
    archive, the sign of a truncated download), or None. Shared by every model directory check."""
    if not path.is_file():
        return "missing"
    if path.stat().st_size == 0:
        return "empty"
    if checkpoint and not zipfile.is_zipfile(path):
        return "not a torch.save archive (truncated download?)"
    return None


def model_dir_problems(model_dir: Path) -> list[str]:
    """One line per required file that is missing or malformed (empty list: the directory is complete).

    Cheap checks only (nothing is loaded): present, not empty, checkpoints are torch.save archives (a truncated
    download is not), JSON parses.
    """
    if not model_dir.is_dir():
        return [f"{name}: missing" for name in REQUIRED_FILES]
    problems = []
    for name in REQUIRED_FILES:
        path = model_dir / name
        problem = file_problem(path, checkpoint=name in CHECKPOINT_FILES)
        if problem:
            problems.append(f"{name}: {problem}")
        elif name in TOKENIZER_JSON_FILES:
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problems.append(f"{name}: invalid JSON ({exc})")
    return problems
