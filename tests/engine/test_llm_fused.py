"""Fused q|k|v and gate|up projections: checkpoints keep the official per-projection keys, and the fused layer
computes exactly what the separate official projections compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from speech_lm.config import Qwen2Config

QWEN = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=48, vocab_size=64)


def official_state(seed: int) -> dict[str, torch.Tensor]:
    """A state dict with the official key names and random values drawn per key (not from our module)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {k: v.shape for k, v in CosyVoice2LM(LLMConfig(qwen=QWEN, speech_token_size=40)).state_dict().items()}
    state = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]  # tied, as in llm.pt
    return state


def loaded(state: dict[str, torch.Tensor]) -> CosyVoice2LM:
    lm = CosyVoice2LM(LLMConfig(qwen=QWEN, speech_token_size=40))
    lm.load_state_dict(state, strict=True)
    return lm.eval()


def test_state_dict_uses_official_keys_and_round_trips() -> None:
    state = official_state(0)
    assert "llm.model.model.layers.1.self_attn.k_proj.bias" in state
    assert "llm.model.model.layers.0.mlp.up_proj.weight" in state
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in state)
    again = loaded(state).state_dict()
    assert again.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(again[key], value), key


def test_saved_parts_do_not_share_storage() -> None:
    state = loaded(official_state(1)).state_dict()
    q = state["llm.model.model.layers.0.self_attn.q_proj.weight"]
    k = state["llm.model.model.layers.0.self_attn.k_proj.weight"]
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


@torch.no_grad()
def test_fused_layer_equals_separate_official_projections() -> None:
    state = official_state(2)
    lm = loaded(state)
    layer = lm.body.layers[0]
    prefix = "llm.model.model.layers.0."
    x = torch.randn(2, 5, QWEN.hidden_size)

    def proj(name: str, bias: bool = True) -> torch.Tensor:
        return F.linear(x, state[f"{prefix}{name}.weight"], state[f"{prefix}{name}.bias"] if bias else None)

    separate = torch.cat([proj("self_attn.q_proj"), proj("self_attn.k_proj"), proj("self_attn.v_proj")], dim=-1)
    torch.testing.assert_close(layer.self_attn.qkv_proj(x), separate, rtol=1e-6, atol=1e-6)
    mlp = F.linear(F.silu(proj("mlp.gate_proj", False)) * proj("mlp.up_proj", False),
                   state[f"{prefix}mlp.down_proj.weight"])
    torch.testing.assert_close(layer.mlp(x), mlp, rtol=1e-5, atol=1e-5)
