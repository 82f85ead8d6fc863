"""DiT token2wav: the released layout (every key and shape), strict loading, flow.yaml parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cosyvoice2.dit.config import DiTConfigError, DiTFlowConfig
from cosyvoice2.dit.flow import DiTFlow
from cosyvoice2.dit.loading import load_dit_token2wav
from cosyvoice2.testing.dit import micro_dit_config, write_full_size_layout
from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from speech_lm.checkpoints import CheckpointMismatchError
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity_dit"
# released Step-Audio-2-mini token2wav sizes (docs/engine.md, "DiT token2wav")
FLOW_KEYS, FLOW_PARAMS = 605, 155_802_352
HIFT_KEYS, HIFT_PARAMS = 328, 20_821_295


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


def released_shapes(file: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for line in (PARITY_DIR / "keys_full.txt").read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, key, shape, dtype = line.split("\t")
        assert dtype == "float32"
        if name == file:
            out[key] = tuple(int(x) for x in shape.strip("[]").split(",") if x.strip())
    return out


@pytest.fixture(scope="module")
def released_flow() -> DiTFlow:
    with torch.device("meta"):
        return DiTFlow(DiTFlowConfig())


def test_released_flow_counts(released_flow: DiTFlow) -> None:
    assert len(released_flow.state_dict()) == FLOW_KEYS
    assert sum(p.numel() for p in released_flow.parameters()) == FLOW_PARAMS
    estimator = released_flow.decoder.estimator
    assert sum(p.numel() for p in estimator.blocks[0].parameters()) == 7_089_408
    assert sum(p.numel() for p in estimator.parameters()) == 114_555_472


@pytest.mark.skipif(not (PARITY_DIR / "keys_full.txt").exists(), reason="DiT parity data absent")
def test_released_key_list_matches(released_flow: DiTFlow) -> None:
    assert shapes(released_flow) == released_shapes("flow.pt")
    with torch.device("meta"):
        hift = HiFTGenerator(HiFTConfig())
    assert shapes(hift) == released_shapes("hift.pt")
    assert len(shapes(hift)) == HIFT_KEYS and sum(p.numel() for p in hift.parameters()) == HIFT_PARAMS


def test_full_size_random_checkpoint_loads_strictly(tmp_path: Path) -> None:
    model_dir = write_full_size_layout(tmp_path / "token2wav")
    assert sum(f.stat().st_size for f in model_dir.iterdir()) < 20_000_000  # stride-0 views: small on disk
    engine = load_dit_token2wav(model_dir)
    assert engine.flow.config == DiTFlowConfig()
    assert sum(p.numel() for p in engine.flow.parameters()) == FLOW_PARAMS
    assert engine.hift.config == HiFTConfig()
    # every parameter came from the file (none left on the meta device or re-initialised)
    state = torch.load(model_dir / "flow.pt", weights_only=True)
    for name, tensor in engine.flow.state_dict().items():
        assert torch.equal(first_row(tensor), first_row(state[name])), name


def first_row(tensor: torch.Tensor) -> torch.Tensor:
    while tensor.dim() > 1:
        tensor = tensor[0]
    return tensor


def test_checkpoint_mismatch_names_the_keys(tmp_path: Path) -> None:
    model_dir = write_full_size_layout(tmp_path / "token2wav")
    state = torch.load(model_dir / "flow.pt", weights_only=True)
    state.pop("decoder.estimator.blocks.3.attn.q_norm.weight")
    state["decoder.estimator.blocks.3.extra"] = torch.zeros(1)
    state["encoder_proj.bias"] = torch.zeros(81)
    torch.save(state, model_dir / "flow.pt")
    with pytest.raises(CheckpointMismatchError) as error:
        load_dit_token2wav(model_dir)
    message = str(error.value)
    assert "blocks.3.attn.q_norm.weight" in message and "blocks.3.extra" in message
    assert "encoder_proj.bias: file (81,), model (80,)" in message


def test_missing_file_is_named(tmp_path: Path) -> None:
    model_dir = write_full_size_layout(tmp_path / "token2wav")
    (model_dir / "hift.pt").unlink()
    with pytest.raises(FileNotFoundError, match="hift.pt"):
        load_dit_token2wav(model_dir)


def test_flow_yaml_round_trip_and_micro_file() -> None:
    for config in (DiTFlowConfig(), micro_dit_config()):
        assert DiTFlowConfig.from_flow_yaml(config.to_flow_yaml()) == config
    if (PARITY_DIR / "micro" / "flow.yaml").exists():
        assert DiTFlowConfig.from_flow_yaml(PARITY_DIR / "micro" / "flow.yaml") == micro_dit_config()


def test_unet_flow_yaml_is_refused() -> None:
    text = DiTFlowConfig().to_flow_yaml().replace("decoder_dit.DiT", "decoder.ConditionalDecoder")
    with pytest.raises(DiTConfigError, match="ConditionalDecoder"):
        DiTFlowConfig.from_flow_yaml(text)
    with pytest.raises(DiTConfigError, match="pos_enc_layer_type"):
        DiTFlowConfig.from_flow_yaml(DiTFlowConfig().to_flow_yaml().replace("'rel_pos_espnet'", "'rel_pos'"))
