"""CosyVoice3 engine fixtures: the micro oracle (released layout, seeded random weights) and the reference
implementation's outputs for it (``parity_cv3``; its README says how the arrays are fed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import FIXTURES_DIR
from tests.oracle import max_abs  # noqa: F401 - the parity tests import it from here

PARITY_DIR = FIXTURES_DIR / "parity_cv3"
MICRO_DIR = PARITY_DIR / "micro"
DUMP_FILE = PARITY_DIR / "micro_dump_seed1234.npz"

needs_parity_data = pytest.mark.skipif(not DUMP_FILE.exists(), reason="parity data absent")




def harness() -> dict:
    return json.loads((MICRO_DIR / "harness_config.json").read_text())


def micro_text_rows(ids: np.ndarray) -> list[int]:
    """The micro model's text-row rule (harness_config `micro_text`): `<|endofprompt|>` is looked up as the last
    row of the 512-row text embedding, every other id as itself."""
    rule = harness()["micro_text"]
    return [rule["endofprompt_row"] if int(i) == rule["endofprompt_id"] else int(i) for i in np.ravel(ids)]


@pytest.fixture(scope="session")
def dump() -> dict[str, np.ndarray]:
    with np.load(DUMP_FILE) as arrays:
        return {k: arrays[k] for k in arrays.files}


@pytest.fixture(scope="session")
def meta(dump) -> dict:
    return json.loads(str(dump["meta"]))


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The oracle's files in a released directory: the yaml and checkpoints, plus `CosyVoice-BlankEN/config.json`
    written from the harness's Qwen2 config (a release ships it; the oracle keeps it in harness_config.json)."""
    from cosyvoice3.layout import CHECKPOINT_FILES, MODEL_YAML, QWEN_CONFIG

    root = tmp_path_factory.mktemp("cv3_micro")
    for name in (MODEL_YAML, *CHECKPOINT_FILES):
        shutil.copy(MICRO_DIR / name, root / name)
    (root / QWEN_CONFIG).parent.mkdir()
    (root / QWEN_CONFIG).write_text(json.dumps(harness()["llm"]["qwen"]))
    return root


@pytest.fixture(scope="session")
def micro_config(micro_model_dir):
    from cosyvoice3.config import CosyVoice3Config

    return CosyVoice3Config.from_model_dir(micro_model_dir, endofprompt_id=harness()["micro_text"]["endofprompt_row"])


@pytest.fixture(scope="session")
def micro_token2wav(micro_model_dir, dump):
    """Flow + HiFT of the oracle, the HiFT noise tables seeded as the dump says."""
    from cosyvoice3.loading import load_config, load_flow, load_hift
    from cosyvoice3.token2wav import CosyVoice3Token2Wav

    config = load_config(micro_model_dir, hift_noise_seed=int(dump["in_hift_noise_seed"]))
    return CosyVoice3Token2Wav(load_flow(micro_model_dir / "flow.pt", config),
                               load_hift(micro_model_dir / "hift.pt", config))


@pytest.fixture(scope="session")
def voice(dump):
    from cosyvoice3.token2wav import VoicePrompt

    return VoicePrompt.from_arrays(dump["in_prompt_speech_token"][0], dump["in_prompt_feat"][0], dump["in_xvector"][0])
