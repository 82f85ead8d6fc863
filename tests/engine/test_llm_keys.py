"""State-dict keys and shapes of CosyVoice2LM at the released configuration equal the released llm.pt
(docs/reference/cosyvoice2.md#llm-state-dict)."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig


@pytest.fixture()
def released_on_meta(monkeypatch: pytest.MonkeyPatch) -> CosyVoice2LM:
    """The released-size model without weights. Embedding init (normal_) is skipped: values are irrelevant here,
    and normal_ on meta tensors imports torch._dynamo, which breaks when a stray ``triton`` directory is importable."""
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", lambda self: None)
    with torch.device("meta"):
        return CosyVoice2LM(LLMConfig())


def spec_llm_keys() -> dict[str, tuple[int, ...]]:
    """llm.pt of CosyVoice2-0.5B as listed in docs/reference/cosyvoice2.md#llm-state-dict (295 keys)."""
    keys: dict[str, tuple[int, ...]] = {
        "llm_embedding.weight": (2, 896),
        "llm.model.model.embed_tokens.weight": (151936, 896),
        "llm.model.model.norm.weight": (896,),
        "llm.model.lm_head.weight": (151936, 896),
        "speech_embedding.weight": (6564, 896),
        "llm_decoder.weight": (6564, 896),
        "llm_decoder.bias": (6564,),
    }
    per_layer = {
        "self_attn.q_proj.weight": (896, 896), "self_attn.q_proj.bias": (896,),
        "self_attn.k_proj.weight": (128, 896), "self_attn.k_proj.bias": (128,),
        "self_attn.v_proj.weight": (128, 896), "self_attn.v_proj.bias": (128,),
        "self_attn.o_proj.weight": (896, 896),
        "mlp.gate_proj.weight": (4864, 896), "mlp.up_proj.weight": (4864, 896), "mlp.down_proj.weight": (896, 4864),
        "input_layernorm.weight": (896,), "post_attention_layernorm.weight": (896,),
    }
    for layer in range(24):
        for name, shape in per_layer.items():
            keys[f"llm.model.model.layers.{layer}.{name}"] = shape
    return keys


def test_released_state_dict_matches_spec(released_on_meta: CosyVoice2LM) -> None:
    ours = {k: tuple(v.shape) for k, v in released_on_meta.state_dict().items()}
    assert len(ours) == 295
    assert ours == spec_llm_keys()


def test_released_unique_parameter_count(released_on_meta: CosyVoice2LM) -> None:
    # docs/reference/cosyvoice2.md#sizes (tied embedding counted once)
    assert sum(p.numel() for p in released_on_meta.parameters()) == 505_803_812
