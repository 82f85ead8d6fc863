"""Released CosyVoice2-0.5B flow: module keys and shapes equal the released flow.pt
(docs/reference/cosyvoice2.md#flow-state-dict)."""

from __future__ import annotations

import torch

from cosyvoice2.flow import CausalFlow, FlowConfig

W, HEADS, FFN = 512, 8, 2048  # encoder
C, TEMB, INNER = 256, 1024, 512  # estimator


def encoder_layer_keys(prefix: str) -> dict[str, tuple[int, ...]]:
    keys: dict[str, tuple[int, ...]] = {}
    for name in ("linear_q", "linear_k", "linear_v", "linear_out"):
        keys[f"{prefix}.self_attn.{name}.weight"] = (W, W)
        keys[f"{prefix}.self_attn.{name}.bias"] = (W,)
    keys[f"{prefix}.self_attn.linear_pos.weight"] = (W, W)
    keys[f"{prefix}.self_attn.pos_bias_u"] = (HEADS, W // HEADS)
    keys[f"{prefix}.self_attn.pos_bias_v"] = (HEADS, W // HEADS)
    keys[f"{prefix}.feed_forward.w_1.weight"] = (FFN, W)
    keys[f"{prefix}.feed_forward.w_1.bias"] = (FFN,)
    keys[f"{prefix}.feed_forward.w_2.weight"] = (W, FFN)
    keys[f"{prefix}.feed_forward.w_2.bias"] = (W,)
    for norm in ("norm_ff", "norm_mha"):
        keys[f"{prefix}.{norm}.weight"] = (W,)
        keys[f"{prefix}.{norm}.bias"] = (W,)
    return keys


def expected_encoder_keys() -> dict[str, tuple[int, ...]]:
    keys: dict[str, tuple[int, ...]] = {}
    for embed in ("embed", "up_embed"):
        keys[f"encoder.{embed}.out.0.weight"] = (W, W)
        keys[f"encoder.{embed}.out.0.bias"] = (W,)
        keys[f"encoder.{embed}.out.1.weight"] = (W,)
        keys[f"encoder.{embed}.out.1.bias"] = (W,)
    keys["encoder.pre_lookahead_layer.conv1.weight"] = (W, W, 4)
    keys["encoder.pre_lookahead_layer.conv1.bias"] = (W,)
    keys["encoder.pre_lookahead_layer.conv2.weight"] = (W, W, 3)
    keys["encoder.pre_lookahead_layer.conv2.bias"] = (W,)
    for i in range(6):
        keys.update(encoder_layer_keys(f"encoder.encoders.{i}"))
    for i in range(4):
        keys.update(encoder_layer_keys(f"encoder.up_encoders.{i}"))
    keys["encoder.up_layer.conv.weight"] = (W, W, 5)
    keys["encoder.up_layer.conv.bias"] = (W,)
    keys["encoder.after_norm.weight"] = (W,)
    keys["encoder.after_norm.bias"] = (W,)
    return keys


def resnet_keys(prefix: str, dim_in: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.mlp.1.weight": (C, TEMB),
        f"{prefix}.mlp.1.bias": (C,),
        f"{prefix}.block1.block.0.weight": (C, dim_in, 3),
        f"{prefix}.block1.block.0.bias": (C,),
        f"{prefix}.block1.block.2.weight": (C,),
        f"{prefix}.block1.block.2.bias": (C,),
        f"{prefix}.block2.block.0.weight": (C, C, 3),
        f"{prefix}.block2.block.0.bias": (C,),
        f"{prefix}.block2.block.2.weight": (C,),
        f"{prefix}.block2.block.2.bias": (C,),
        f"{prefix}.res_conv.weight": (C, dim_in, 1),
        f"{prefix}.res_conv.bias": (C,),
    }


def transformer_keys(prefix: str) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.norm1.weight": (C,),
        f"{prefix}.norm1.bias": (C,),
        f"{prefix}.attn1.to_q.weight": (INNER, C),
        f"{prefix}.attn1.to_k.weight": (INNER, C),
        f"{prefix}.attn1.to_v.weight": (INNER, C),
        f"{prefix}.attn1.to_out.0.weight": (C, INNER),
        f"{prefix}.attn1.to_out.0.bias": (C,),
        f"{prefix}.norm3.weight": (C,),
        f"{prefix}.norm3.bias": (C,),
        f"{prefix}.ff.net.0.proj.weight": (4 * C, C),
        f"{prefix}.ff.net.0.proj.bias": (4 * C,),
        f"{prefix}.ff.net.2.weight": (C, 4 * C),
        f"{prefix}.ff.net.2.bias": (C,),
    }


def stage_keys(prefix: str, dim_in: int, with_conv: bool) -> dict[str, tuple[int, ...]]:
    keys = resnet_keys(f"{prefix}.0", dim_in)
    for i in range(4):
        keys.update(transformer_keys(f"{prefix}.1.{i}"))
    if with_conv:
        keys[f"{prefix}.2.weight"] = (C, C, 3)
        keys[f"{prefix}.2.bias"] = (C,)
    return keys


def expected_estimator_keys() -> dict[str, tuple[int, ...]]:
    p = "decoder.estimator"
    keys: dict[str, tuple[int, ...]] = {
        f"{p}.time_mlp.linear_1.weight": (TEMB, 320),
        f"{p}.time_mlp.linear_1.bias": (TEMB,),
        f"{p}.time_mlp.linear_2.weight": (TEMB, TEMB),
        f"{p}.time_mlp.linear_2.bias": (TEMB,),
    }
    keys.update(stage_keys(f"{p}.down_blocks.0", 320, with_conv=True))
    for i in range(12):
        keys.update(stage_keys(f"{p}.mid_blocks.{i}", C, with_conv=False))
    keys.update(stage_keys(f"{p}.up_blocks.0", 2 * C, with_conv=True))
    keys[f"{p}.final_block.block.0.weight"] = (C, C, 3)
    keys[f"{p}.final_block.block.0.bias"] = (C,)
    keys[f"{p}.final_block.block.2.weight"] = (C,)
    keys[f"{p}.final_block.block.2.bias"] = (C,)
    keys[f"{p}.final_proj.weight"] = (80, C, 1)
    keys[f"{p}.final_proj.bias"] = (80,)
    return keys


def test_spec_tables_have_the_published_counts() -> None:
    assert len(expected_encoder_keys()) == 206
    assert len(expected_estimator_keys()) == 910


def test_released_flow_keys_and_shapes_equal_spec() -> None:
    with torch.device("meta"):
        flow = CausalFlow(FlowConfig())
    expected = {
        "input_embedding.weight": (6561, W),
        "spk_embed_affine_layer.weight": (80, 192),
        "spk_embed_affine_layer.bias": (80,),
        "encoder_proj.weight": (80, W),
        "encoder_proj.bias": (80,),
        **expected_encoder_keys(),
        **expected_estimator_keys(),
    }
    actual = {name: tuple(t.shape) for name, t in flow.state_dict().items()}
    assert sorted(set(actual) - set(expected)) == []
    assert sorted(set(expected) - set(actual)) == []
    assert {k: v for k, v in actual.items() if expected[k] != v} == {}
    assert len(actual) == 1121
