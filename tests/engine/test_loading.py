"""Loading an official-layout model directory: required files, strict keys/shapes, dtypes, config sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cosyvoice2
from cosyvoice2.config import EngineConfig, resolve_dtype
from speech_lm.checkpoints import CheckpointMismatchError
from cosyvoice2.testing import tiny_config
from tests.conftest import FIXTURES_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS_CONFIG = FIXTURES_DIR / "parity" / "micro" / "harness_config.json"


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


@pytest.mark.parametrize(
    "name", ["llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx", "CosyVoice-BlankEN"]
)
def test_missing_official_file_is_named(model_copy: Path, name: str) -> None:
    target = model_copy / name
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(FileNotFoundError, match=name):
        cosyvoice2.load(model_copy)


def edit_checkpoint(path: Path, edit) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def test_unexpected_key_is_named_with_its_file(model_copy: Path) -> None:
    edit_checkpoint(model_copy / "llm.pt", lambda s: s.__setitem__("llm.extra_head.weight", torch.zeros(3)))
    with pytest.raises(CheckpointMismatchError, match=r"llm\.pt.*unexpected keys \(1\): llm\.extra_head\.weight"):
        cosyvoice2.load(model_copy)


def test_missing_key_is_named_with_its_file(model_copy: Path) -> None:
    edit_checkpoint(model_copy / "flow.pt", lambda s: s.pop("encoder.after_norm.bias"))
    with pytest.raises(CheckpointMismatchError, match=r"flow\.pt.*missing keys \(1\): encoder\.after_norm\.bias"):
        cosyvoice2.load(model_copy)


def test_wrong_shape_is_named_with_both_shapes(model_copy: Path) -> None:
    key = "conv_pre.parametrizations.weight.original1"
    edit_checkpoint(model_copy / "hift.pt", lambda s: s.__setitem__(key, torch.zeros(16, 80, 5)))
    with pytest.raises(CheckpointMismatchError, match=rf"hift\.pt.*wrong shapes \(1\): {key}: file \(16, 80, 5\), "
                                                      rf"model \(16, 80, 7\)"):
        cosyvoice2.load(model_copy)


def test_config_mismatch_reports_every_difference(model_copy: Path) -> None:
    # an engine_config.json that disagrees with the weights (one LLM layer more) names the first layer-2 keys
    config = json.loads((model_copy / "engine_config.json").read_text())
    config["llm"]["qwen"]["num_hidden_layers"] = 3
    (model_copy / "engine_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatchError, match=r"llm\.pt.*missing keys \(12\): llm\.model\.model\.layers\.2\."):
        cosyvoice2.load(model_copy)


def test_tiny_model_uses_its_engine_config(tiny_engine) -> None:
    assert tiny_engine.config == tiny_config()
    assert tiny_engine.config != EngineConfig()
    assert tiny_engine.llm.config.qwen.hidden_size == 64


def test_blank_en_config_sets_the_qwen_body_without_engine_config(model_copy: Path) -> None:
    (model_copy / "engine_config.json").unlink()
    config = EngineConfig.for_model_dir(model_copy)
    assert config.llm.qwen == tiny_config().llm.qwen  # from CosyVoice-BlankEN/config.json
    assert config.flow == EngineConfig().flow  # released default


@pytest.mark.skipif(not HARNESS_CONFIG.is_file(), reason="parity data absent")
def test_tiny_config_is_the_parity_micro_config() -> None:
    assert tiny_config() == EngineConfig.from_harness(json.loads(HARNESS_CONFIG.read_text()))


def test_config_round_trips_through_json() -> None:
    for config in (EngineConfig(), tiny_config()):
        assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("dtype", ["bf16", torch.float16])
def test_half_precision_keeps_hift_in_fp32(tiny_model_dir: Path, tiny_prompt, dtype) -> None:
    engine = cosyvoice2.load(tiny_model_dir, dtype=dtype)
    expected = resolve_dtype(dtype)
    assert engine.llm.llm_decoder.weight.dtype == expected
    assert engine.token2wav_engine.flow.input_embedding.weight.dtype == expected
    assert {p.dtype for p in engine.token2wav_engine.hift.parameters()} == {torch.float32}
    audio = engine.token2wav(list(range(40)), tiny_prompt, seed=0)
    assert audio.dtype == np.float32 and len(audio) == 40 * 960 and np.isfinite(audio).all()
    tokens = list(engine.speech_tokens("Hi.", tiny_prompt, seed=0))
    assert all(0 <= t < 6561 for t in tokens)


def test_resolve_dtype_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8")
    with pytest.raises(ValueError):
        resolve_dtype(torch.float64)


def test_package_import_is_torch_free_and_lazy() -> None:
    code = ("import sys, cosyvoice2; assert 'torch' not in sys.modules, 'torch imported'; "
            "cosyvoice2.load; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


PARITY_MICRO = FIXTURES_DIR / "parity" / "micro"


@pytest.mark.skipif(not PARITY_MICRO.is_dir(), reason="parity data absent")
@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_tiny_checkpoints_have_the_official_keys_and_shapes(tiny_model_dir: Path, name: str) -> None:
    # the parity micro files were written by the upstream reference code at the same dimensions
    ours = torch.load(tiny_model_dir / name, weights_only=True)
    reference = torch.load(PARITY_MICRO / name, weights_only=True)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in reference.items()}


def test_tiny_llm_checkpoint_ties_lm_head_to_the_text_embedding(tiny_model_dir: Path) -> None:
    state = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    head, embed = state["llm.model.lm_head.weight"], state["llm.model.model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
