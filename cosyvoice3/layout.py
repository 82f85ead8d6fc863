"""File names of a released Fun-CosyVoice3-0.5B-2512 directory, and the cheap check of one. Torch-free, so the
build tool can check a download without loading anything."""

from __future__ import annotations

import json
from pathlib import Path

from cosyvoice2.layout import file_problem

#: The release on the Hugging Face hub; ModelScope publishes it under the same name.
RELEASE_REPO = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
RELEASE_DIRNAME = "Fun-CosyVoice3-0.5B-2512"

MODEL_YAML = "cosyvoice3.yaml"
LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
TOKENIZER_SUBDIR = "CosyVoice-BlankEN"
QWEN_CONFIG = f"{TOKENIZER_SUBDIR}/config.json"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"

CHECKPOINT_FILES = (LLM_FILE, FLOW_FILE, HIFT_FILE)
#: What text -> ids needs (the Qwen2 BPE files of CosyVoice-BlankEN) and what reference audio -> voice needs.
TOKENIZER_FILES = tuple(f"{TOKENIZER_SUBDIR}/{name}" for name in ("vocab.json", "merges.txt", "tokenizer_config.json"))
FRONTEND_FILES = (CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
#: What the engine (LLM + token2wav) reads; the ONNX frontend files serve prompt preparation.
ENGINE_FILES = (MODEL_YAML, QWEN_CONFIG, *CHECKPOINT_FILES)
#: Everything of a release that text-level synthesis from a reference recording reads: what the build tool
#: downloads and checks. Whatever else the repository holds is never read (llm.pt carries the Qwen2 weights, so
#: BlankEN's own weights are not needed).
RELEASED_FILES = (*ENGINE_FILES, *TOKENIZER_FILES, *FRONTEND_FILES)


def released_dir_problems(model_dir: Path) -> list[str]:
    """One line per released file that is missing or malformed, in `RELEASED_FILES` order (empty: complete).

    Cheap checks only, nothing is loaded: present, not empty, the checkpoints are torch.save archives (a truncated
    download is not), the JSON files parse.
    """
    problems = []
    for name in RELEASED_FILES:
        path = Path(model_dir) / name
        problem = file_problem(path, checkpoint=name in CHECKPOINT_FILES)
        if problem is None and name.endswith(".json"):
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problem = f"invalid JSON ({exc})"
        if problem:
            problems.append(f"{name}: {problem}")
    return problems
