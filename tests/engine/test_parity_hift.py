"""HiFT parity against the upstream reference outputs on the micro model (parity/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyvoice2.hift import HiFTConfig, HiFTGenerator, SourceNoise
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity"
pytestmark = [
    pytest.mark.parity,
    pytest.mark.skipif(not (PARITY_DIR / "micro" / "hift.pt").exists(), reason="parity data absent"),
]


@pytest.fixture(scope="module")
def dump() -> dict[str, torch.Tensor]:
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        return {k: torch.from_numpy(arrays[k]) for k in arrays.files if k.startswith(("hift_", "in_hift_"))}


@pytest.fixture(scope="module")
def config() -> HiFTConfig:
    harness = json.loads((PARITY_DIR / "micro" / "harness_config.json").read_text())
    return HiFTConfig.from_dict(harness["hift"])


@pytest.fixture()
def model(config: HiFTConfig) -> HiFTGenerator:
    return HiFTGenerator.from_checkpoint(PARITY_DIR / "micro" / "hift.pt", config)


def stored_noise(dump: dict[str, torch.Tensor]) -> SourceNoise:
    return SourceNoise(dump["hift_noise_rand_ini"], dump["hift_noise_sine_randn"])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_micro_checkpoint_loads_strictly(config: HiFTConfig) -> None:
    state = HiFTGenerator.read_state_dict(PARITY_DIR / "micro" / "hift.pt")
    assert len(state) == 328
    model = HiFTGenerator(config)
    model.load_state_dict(state, strict=True)
    assert sum(p.numel() for p in model.parameters()) == 38895


def test_generator_prefix_is_stripped(tmp_path: Path) -> None:
    state = torch.load(PARITY_DIR / "micro" / "hift.pt", weights_only=True)
    torch.save({f"generator.{k}": v for k, v in state.items()}, tmp_path / "hift.pt")
    assert HiFTGenerator.read_state_dict(tmp_path / "hift.pt").keys() == state.keys()


def test_f0_source_audio_match_reference(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    mel = dump["in_hift_mel"]
    audio, source = model.inference(mel, torch.zeros(1, 1, 0), noise=stored_noise(dump))
    with torch.inference_mode():
        f0 = model.predict_f0(mel)
    assert max_diff(f0, dump["hift_f0"]) < 1e-3
    assert max_diff(source, dump["hift_source"]) < 1e-3
    assert max_diff(audio, dump["hift_audio"]) < 5e-3


def test_decoder_given_reference_source(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    with torch.inference_mode():
        audio = model.decode(dump["in_hift_mel"], dump["hift_source"])
    assert max_diff(audio, dump["hift_audio"]) < 1e-4


def test_seeded_generator_reproduces_upstream_draws(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    # Upstream draws from the global generator after torch.manual_seed(in_hift_seed); a private
    # generator with the same seed must give the same source without touching global state.
    generator = torch.Generator().manual_seed(int(dump["in_hift_seed"]))
    _, source = model.inference(dump["in_hift_mel"], generator=generator)
    assert max_diff(source, dump["hift_source"]) < 1e-3


def test_other_noise_changes_audio(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    audio, _ = model.inference(dump["in_hift_mel"], generator=torch.Generator().manual_seed(7))
    assert max_diff(audio, dump["hift_audio"]) > 1e-2


def test_cache_source_overwrites_start(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    cache = torch.full((1, 1, 3840), 0.25)
    _, source = model.inference(dump["in_hift_mel"], cache, noise=stored_noise(dump))
    assert torch.equal(source[:, :, :3840], cache)
    assert max_diff(source[:, :, 3840:], dump["hift_source"][:, :, 3840:]) < 1e-3


def test_folding_weight_norm_keeps_output(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    noise = stored_noise(dump)
    before, _ = model.inference(dump["in_hift_mel"], noise=noise)
    assert model.fold_weight_norm() == 1 + 5 + 3 + 2 * 3 * 12 + 1  # pre, f0 convs, ups, 12 resblocks, post
    assert not any("parametrizations" in k for k in model.state_dict())
    after, _ = model.inference(dump["in_hift_mel"], noise=noise)
    assert max_diff(after, before) < 1e-5


def test_batch_rows_are_independent(model: HiFTGenerator, dump: dict[str, torch.Tensor]) -> None:
    mel = dump["in_hift_mel"]
    other_mel = mel.flip(-1)
    noise = stored_noise(dump)
    other_noise = model.draw_noise(1, mel.shape[2], torch.Generator().manual_seed(3))
    batch_noise = SourceNoise(torch.cat([noise.initial_phase, other_noise.initial_phase]),
                              torch.cat([noise.sine_noise, other_noise.sine_noise]))
    audio, source = model.inference(torch.cat([mel, other_mel]), noise=batch_noise)
    assert max_diff(source[:1], dump["hift_source"]) < 1e-3
    assert max_diff(audio[:1], dump["hift_audio"]) < 5e-3
    single_audio, single_source = model.inference(other_mel, noise=other_noise)
    # batched kernels round differently; the harmonic phase amplifies that (README: tolerance 5e-3)
    assert max_diff(source[1:], single_source) < 1e-3
    assert max_diff(audio[1:], single_audio) < 5e-3
