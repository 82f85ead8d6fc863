"""Random-weight CosyVoice2 model directories in the official layout (docs/reference/cosyvoice2.md#model-directory),
for tests and benchmarks.

`write_tiny_model` uses the parity harness's micro dimensions (`tiny_config`, written out here so it works
without the shared data) and seeded random weights drawn by us; the files are read by `cosyvoice2.load`
exactly like the released ones: llm.pt / flow.pt / hift.pt with the official key names (HiFT weight norm as
`parametrizations.weight.original0/1`, llm.pt with the tied `lm_head`), campplus.onnx and
speech_tokenizer_v2.onnx stand-ins, CosyVoice-BlankEN/ (tokenizer + Qwen2 config.json) and an
`engine_config.json` recording the small dimensions.

`write_full_size_random_model` writes the released sizes (for GPU benchmarks). Its tokenizer is still the tiny
byte-level one, padded so that `<|endoftext|>` = 151643 and the 17 CosyVoice2 specials get their real ids.
Random weights never stop sensibly: use the pipeline's `fixed_token_count` (benchmark mode) with them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cosyvoice2.config import QWEN_CONFIG_FILE, TOKENIZER_SUBDIR, EngineConfig
from cosyvoice2.flow import CausalFlow, EncoderConfig, EstimatorConfig, FlowConfig
from cosyvoice2.testing.frontend_models import write_tiny_frontend_models
from cosyvoice2.hift import HiFTConfig, HiFTGenerator
from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from speech_lm.config import Qwen2Config
from cosyvoice2.loading import FLOW_FILE, HIFT_FILE, LLM_FILE
from speech_lm.testing import write_test_tokenizer

RELEASED_TEXT_VOCAB = 151643  # regular Qwen2 vocabulary entries; <|endoftext|> follows


def tiny_config() -> EngineConfig:
    """The parity harness's micro dimensions (its harness_config.json)."""
    return EngineConfig(
        llm=LLMConfig(qwen=Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, vocab_size=512)),
        flow=FlowConfig(
            encoder=EncoderConfig(width=16, attention_heads=2, linear_units=64, num_blocks=1),
            estimator=EstimatorConfig(channels=16, attention_head_dim=16, num_heads=2, n_blocks=1,
                                      num_mid_blocks=2),
        ),
        hift=HiFTConfig(base_channels=16, f0_cond_channels=16),
    )


# ---- random initialisation (the harness's scheme, so outputs have realistic ranges) -----------------------
ParamInit = Callable[[torch.Tensor, torch.Generator], None]


def _normal(std: float) -> ParamInit:
    def init(t: torch.Tensor, g: torch.Generator) -> None:
        t.normal_(0.0, std, generator=g)
    return init


def _uniform(low: float, high: float) -> ParamInit:
    def init(t: torch.Tensor, g: torch.Generator) -> None:
        t.uniform_(low, high, generator=g)
    return init


def _around_one(std: float) -> ParamInit:
    def init(t: torch.Tensor, g: torch.Generator) -> None:
        t.normal_(1.0, std, generator=g)
    return init


def _constant(value: float) -> ParamInit:
    def init(t: torch.Tensor, g: torch.Generator) -> None:
        t.fill_(value)
    return init


def _default_init(owner: nn.Module, leaf: str, t: torch.Tensor) -> ParamInit:
    """Linear/Embedding N(0, .02); norms 1 +- N(0, .05) / N(0, .05); convs N(0, 1/sqrt(fan_in)); WN v N(0,1), g 1;
    Snake alpha U(.5, 1.5); rel-pos biases N(0, .1)."""
    if leaf == "original1":
        return _normal(1.0)
    if leaf == "original0":
        return _constant(1.0)
    if leaf == "alpha":
        return _uniform(0.5, 1.5)
    if leaf in ("pos_bias_u", "pos_bias_v"):
        return _normal(0.1)
    if "Norm" in type(owner).__name__:
        return _around_one(0.05) if leaf == "weight" else _normal(0.05)
    if isinstance(owner, (nn.Conv1d, nn.ConvTranspose1d)) and leaf == "weight":
        fan_in = t.shape[1] * t.shape[2] if isinstance(owner, nn.Conv1d) else t.shape[0] * t.shape[2]
        return _normal(1.0 / math.sqrt(fan_in))
    return _normal(0.02)


def randomize_(module: nn.Module, seed: int, overrides: dict[str, ParamInit] | None = None) -> nn.Module:
    """Draw every parameter in `named_parameters` order from one seeded CPU generator."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    overrides = overrides or {}
    with torch.no_grad():
        for name, param in module.named_parameters():
            owner_name, _, leaf = name.rpartition(".")
            init = overrides.get(name) or _default_init(module.get_submodule(owner_name), leaf, param)
            init(param, generator)
    return module


def _llm_overrides(config: LLMConfig) -> dict[str, ParamInit]:
    return {"llm_decoder.weight": _normal(1.0 / math.sqrt(config.hidden_size))}


def _hift_overrides(config: HiFTConfig) -> dict[str, ParamInit]:
    bins = config.istft_n_fft // 2 + 1

    def conv_post_bias(t: torch.Tensor, g: torch.Generator) -> None:
        t.normal_(0.0, 0.02, generator=g)
        t[:bins] -= 1.5  # log-magnitude channels: keeps the audio mostly below the 0.99 clamp

    return {
        # f0 must span unvoiced (< 10 Hz) and voiced values for the source to be exercised
        "f0_predictor.classifier.weight": _normal(75.0 / math.sqrt(config.f0_cond_channels)),
        "f0_predictor.classifier.bias": _constant(-66.0),
        "m_source.l_linear.weight": _normal(0.5),
        "conv_post.parametrizations.weight.original0": _constant(0.3),
        "conv_post.bias": conv_post_bias,
    }


# ---- writers -------------------------------------------------------------------------------------------------
def _write_checkpoints(path: Path, config: EngineConfig, seed: int, dtype: torch.dtype) -> None:
    llm = CosyVoice2LM(config.llm)
    randomize_(llm, seed, _llm_overrides(config.llm))
    torch.save(llm.to(dtype).state_dict(), path / LLM_FILE)  # lm_head stays tied: one storage, two keys
    del llm
    flow = CausalFlow(config.flow)
    torch.save(randomize_(flow, seed + 1).to(dtype).state_dict(), path / FLOW_FILE)
    del flow
    hift = randomize_(HiFTGenerator(config.hift), seed + 2, _hift_overrides(config.hift))
    torch.save(hift.state_dict(), path / HIFT_FILE)  # fp32, weight norm unfolded: the released key layout


def _write_blank_en(path: Path, qwen: Qwen2Config, base_vocab_size: int | None) -> None:
    write_test_tokenizer(path / TOKENIZER_SUBDIR, base_vocab_size)
    hf_config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
                 "tie_word_embeddings": True, "use_sliding_window": False, "torch_dtype": "float32",
                 **asdict(qwen)}
    (path / QWEN_CONFIG_FILE).write_text(json.dumps(hf_config, indent=1) + "\n", encoding="utf-8")


def write_model_dir(path: str | Path, config: EngineConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                    base_vocab_size: int | None = None) -> Path:
    """Write a complete random-weight model directory for `config`; returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_checkpoints(path, config, seed, dtype)
    write_tiny_frontend_models(path, seed)
    _write_blank_en(path, config.llm.qwen, base_vocab_size)
    config.write(path)
    return path


def write_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Tiny random CosyVoice2 (micro dimensions, fp32, < 10 MB) in the official layout; loads in < 1 s."""
    return write_model_dir(path, tiny_config(), seed)


def write_full_size_random_model(path: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Released-size random weights (LLM + flow in `dtype`, HiFT fp32; about 1.3 GB in bf16, ~1 min on CPU)."""
    return write_model_dir(path, EngineConfig(), seed, dtype, base_vocab_size=RELEASED_TEXT_VOCAB)
