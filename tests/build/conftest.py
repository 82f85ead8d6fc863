"""Fixtures for the build tooling: the parity micro model laid out as an official model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]
PARITY_DIR = FIXTURES_DIR / "parity"
MICRO_DIR = PARITY_DIR / "micro"
#: The micro LLM's text vocabulary has 512 rows; 492 regular entries + 3 base specials + CosyVoice2's 17 new
#: specials make a tokenizer of exactly 512, so speech token 0 lands right after the text rows (as 151663 does
#: for the released model).
MICRO_BASE_VOCAB = 492

requires_parity = pytest.mark.skipif(not (MICRO_DIR / "llm.pt").exists(), reason=f"parity data absent ({MICRO_DIR})")


def write_micro_model_dir(directory: Path) -> Path:
    """llm/flow/hift of the micro model, a tiny BlankEN (tokenizer + Qwen2 config) and placeholder ONNX files."""
    from speech_lm.testing import write_test_tokenizer

    tokenizer_dir = directory / "CosyVoice-BlankEN"
    write_test_tokenizer(tokenizer_dir, base_vocab_size=MICRO_BASE_VOCAB)
    qwen = json.loads((MICRO_DIR / "harness_config.json").read_text())["llm"]["qwen"]
    config = {**qwen, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "transformers_version": "4.51.3"}
    (tokenizer_dir / "config.json").write_text(json.dumps(config))
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        shutil.copy(MICRO_DIR / name, directory / name)
    for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
        (directory / name).write_bytes(b"placeholder: never loaded by the build stages")
    return directory


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (MICRO_DIR / "llm.pt").exists():
        pytest.skip(f"parity data absent ({MICRO_DIR})")
    return write_micro_model_dir(tmp_path_factory.mktemp("micro_model"))


@pytest.fixture(scope="session")
def micro_hf_dir(micro_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cosyvoice_build.hf_llm import convert_llm_to_hf

    out = tmp_path_factory.mktemp("micro_hf")
    convert_llm_to_hf(micro_model_dir, out)
    return out
