"""Released HiFT configuration: module key names and shapes equal the released hift.pt
(docs/reference/cosyvoice2.md#hift-state-dict)."""

from __future__ import annotations

import torch

from cosyvoice2.hift import HiFTConfig, HiFTGenerator


def wn(prefix: str, weight_shape: tuple[int, ...], bias: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.parametrizations.weight.original0": (weight_shape[0], 1, 1),
            f"{prefix}.parametrizations.weight.original1": weight_shape,
            f"{prefix}.bias": (bias,)}


def resblock(prefix: str, channels: int, kernel: int) -> dict[str, tuple[int, ...]]:
    keys: dict[str, tuple[int, ...]] = {}
    for j in range(3):
        keys |= wn(f"{prefix}.convs1.{j}", (channels, channels, kernel), channels)
        keys |= wn(f"{prefix}.convs2.{j}", (channels, channels, kernel), channels)
        keys[f"{prefix}.activations1.{j}.alpha"] = (channels,)
        keys[f"{prefix}.activations2.{j}.alpha"] = (channels,)
    return keys


def spec_key_table() -> dict[str, tuple[int, ...]]:
    """The released hift.pt written out for the released model (base 512, f0 cond 512)."""
    keys: dict[str, tuple[int, ...]] = {"m_source.l_linear.weight": (1, 9), "m_source.l_linear.bias": (1,)}
    for i in range(5):
        keys |= wn(f"f0_predictor.condnet.{2 * i}", (512, 80 if i == 0 else 512, 3), 512)
    keys |= {"f0_predictor.classifier.weight": (1, 512), "f0_predictor.classifier.bias": (1,)}
    keys |= wn("conv_pre", (512, 80, 7), 512)
    keys |= wn("ups.0", (512, 256, 16), 256) | wn("ups.1", (256, 128, 11), 128) | wn("ups.2", (128, 64, 7), 64)
    for i, (out_ch, kernel) in enumerate([(256, 30), (128, 6), (64, 1)]):
        keys[f"source_downs.{i}.weight"] = (out_ch, 18, kernel)
        keys[f"source_downs.{i}.bias"] = (out_ch,)
    for i, (ch, kernel) in enumerate([(256, 7), (128, 7), (64, 11)]):
        keys |= resblock(f"source_resblocks.{i}", ch, kernel)
    for stage, ch in enumerate([256, 128, 64]):
        for j, kernel in enumerate([3, 7, 11]):
            keys |= resblock(f"resblocks.{3 * stage + j}", ch, kernel)
    keys |= wn("conv_post", (18, 64, 7), 18)
    return keys


def test_released_keys_and_shapes_match_spec() -> None:
    with torch.device("meta"):
        model = HiFTGenerator(HiFTConfig())
    actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = spec_key_table()
    assert len(expected) == 328
    assert actual == expected
    assert sum(p.numel() for p in model.parameters()) == 20_821_295


def test_released_config_rates() -> None:
    config = HiFTConfig()
    assert config.samples_per_frame == 480
    assert HiFTConfig.from_dict(config.to_dict()) == config
