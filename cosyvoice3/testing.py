"""Random-weight CosyVoice3 directories in the released layout, for tests and benchmarks.

- `write_tiny_model(dir)`: a small model (Qwen2 hidden 16 with the full 151936-row text vocabulary, so real
  tokenizer ids such as `<|endofprompt|>` work; DiT width 32, depth 2; HiFT base 16): `cosyvoice3.yaml`,
  `CosyVoice-BlankEN/config.json`, `llm.pt`, `flow.pt`, `hift.pt`, seeded; with `text_frontend` also a
  tokenizer in `CosyVoice-BlankEN/` whose special tokens get the released ids (`speech_lm.testing`,
  base vocabulary padded to the released 151643 entries) and tiny random `campplus.onnx` /
  `speech_tokenizer_v3.onnx` with the released interfaces (`cosyvoice2.testing.frontend_models`).
- `write_full_size_layout(dir)`: the released sizes, every key and shape, a few MB on disk: each tensor is a
  stride-0 view of one small random row (the strict loader then loads a full-size model without its memory).
- `write_full_size_model(dir)`: the released sizes with dense random tensors, as a real checkpoint stores them
  (3.4 GB on disk; writing takes about 45 s and 3.5 GB of memory on an idle 2-core machine).
- Both take `text_frontend` as `write_tiny_model` does, for a directory holding every released file.
- `release_yaml(config)`: a `cosyvoice3.yaml` with the released classes and argument names for any config.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from cosyvoice2.hift.config import HiFTConfig
from speech_lm.config import Qwen2Config
from speech_lm.checkpoints import meta_without_init
from cosyvoice2.testing.dit import _cheap_state
from cosyvoice2.testing.frontend_models import write_tiny_frontend_models
from cosyvoice2.testing.models import RELEASED_TEXT_VOCAB, _hift_overrides, _llm_overrides, randomize_
from speech_lm.testing import write_test_tokenizer

from .config import CausalHiFTConfig, CosyVoice3Config, CosyVoice3LLMConfig, DiTConfig, FlowConfig
from .flow import CosyVoice3Flow
from .hift import CausalHiFT
from .layout import FLOW_FILE, HIFT_FILE, LLM_FILE, MODEL_YAML, QWEN_CONFIG, SPEECH_TOKENIZER_FILE, TOKENIZER_SUBDIR
from .llm import CosyVoice3LM


def tiny_config() -> CosyVoice3Config:
    qwen = Qwen2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64)
    return CosyVoice3Config(
        llm=CosyVoice3LLMConfig(qwen=qwen),
        flow=FlowConfig(pre_lookahead_channels=32, dit=DiTConfig(dim=32, depth=2, heads=2, dim_head=16)),
        hift=CausalHiFTConfig(base_channels=16, f0_cond_channels=16))


def qwen_json(config: Qwen2Config) -> str:
    """`CosyVoice-BlankEN/config.json` fields the engine reads (plus the ones a Qwen2 config always has)."""
    values = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "use_sliding_window": False, "tie_word_embeddings": True, **config.__dict__}
    return json.dumps(values, indent=2)


def release_yaml(config: CosyVoice3Config) -> str:
    """The model part of a released `cosyvoice3.yaml` for `config` (classes, argument names and order)."""
    llm, flow, hift, dit = config.llm, config.flow, config.hift, config.flow.dit
    s = llm.sampling
    h = HiFTConfig.to_dict(hift)
    dilations = json.dumps(h["resblock_dilation_sizes"])
    source_dilations = json.dumps(h["source_resblock_dilation_sizes"])
    return f"""# CosyVoice3 model definition (released cosyvoice3.yaml layout)
sample_rate: {config.sample_rate}
llm_input_size: {llm.hidden_size}
llm_output_size: {llm.hidden_size}
spk_embed_dim: {flow.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: {flow.token_mel_ratio}
chunk_size: {dit.static_chunk_size // flow.token_mel_ratio}
num_decoding_left_chunks: {dit.num_decoding_left_chunks}

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {llm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {s.top_p}
        top_k: {s.top_k}
        win_size: {s.win_size}
        tau_r: {s.tau_r}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: {flow.input_size}
    output_size: {flow.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {flow.vocab_size}
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: {flow.pre_lookahead_len}
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: {flow.input_size}
        channels: {flow.pre_lookahead_channels}
        pre_lookahead_len: {flow.pre_lookahead_len}
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {dit.spk_dim}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: {flow.inference_cfg_rate}
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {dit.dim}
            depth: {dit.depth}
            heads: {dit.heads}
            dim_head: {dit.dim_head}
            ff_mult: {dit.ff_mult:g}
            mel_dim: {dit.mel_dim}
            mu_dim: {dit.mu_dim}
            spk_dim: {dit.spk_dim}
            out_channels: {dit.out_channels}
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: {hift.in_channels}
    base_channels: {hift.base_channels}
    nb_harmonics: {hift.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {hift.nsf_alpha}
    nsf_sigma: {hift.nsf_sigma}
    nsf_voiced_threshold: {hift.nsf_voiced_threshold:g}
    upsample_rates: {json.dumps(h["upsample_rates"])}
    upsample_kernel_sizes: {json.dumps(h["upsample_kernel_sizes"])}
    istft_params:
        n_fft: {hift.istft_n_fft}
        hop_len: {hift.istft_hop}
    resblock_kernel_sizes: {json.dumps(h["resblock_kernel_sizes"])}
    resblock_dilation_sizes: {dilations}
    source_resblock_kernel_sizes: {json.dumps(h["source_resblock_kernel_sizes"])}
    source_resblock_dilation_sizes: {source_dilations}
    lrelu_slope: {hift.lrelu_slope}
    audio_limit: {hift.audio_limit}
    conv_pre_look_right: {hift.conv_pre_look_right}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: {hift.in_channels}
        cond_channels: {hift.f0_cond_channels}
"""


def _write_configs(path: Path, config: CosyVoice3Config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / MODEL_YAML).write_text(release_yaml(config))
    (path / QWEN_CONFIG).parent.mkdir(exist_ok=True)
    (path / QWEN_CONFIG).write_text(qwen_json(config.llm.qwen))


def write_tiny_model(path: str | Path, seed: int = 0, config: CosyVoice3Config | None = None,
                     text_frontend: bool = True) -> Path:
    """Seeded random weights in the released layout (fp32; HiFT weight norm unfolded); returns the directory.
    `text_frontend`: also the tokenizer files and the two ONNX frontend models (see the module docstring)."""
    path = Path(path)
    config = config or tiny_config()
    _write_configs(path, config)
    if text_frontend:
        _write_text_frontend(path, seed)
    llm = randomize_(CosyVoice3LM(config.llm), seed, _llm_overrides(config.llm))
    torch.save(llm.state_dict(), path / LLM_FILE)  # lm_head stays tied: one storage, two keys
    torch.save(randomize_(CosyVoice3Flow(config.flow), seed + 1).state_dict(), path / FLOW_FILE)
    hift = randomize_(CausalHiFT(config.hift), seed + 2, _hift_overrides(config.hift))
    torch.save(hift.float().state_dict(), path / HIFT_FILE)  # the release stores the f0 predictor in fp32 too
    return path


def _write_text_frontend(path: Path, seed: int) -> None:
    """The tokenizer files (special tokens at their released ids) and the two tiny ONNX frontend models."""
    write_test_tokenizer(path / TOKENIZER_SUBDIR, base_vocab_size=RELEASED_TEXT_VOCAB)
    write_tiny_frontend_models(path, seed, speech_tokenizer_file=SPEECH_TOKENIZER_FILE)


def full_size_modules() -> tuple[CosyVoice3LM, CosyVoice3Flow, CausalHiFT]:
    """The released-size modules on the meta device (no memory, no init)."""
    config = CosyVoice3Config()
    with meta_without_init():
        return CosyVoice3LM(config.llm), CosyVoice3Flow(config.flow), CausalHiFT(replace(config.hift, noise_seconds=0))


def write_full_size_layout(path: str | Path, seed: int = 0, text_frontend: bool = False) -> Path:
    """Released sizes, every key and shape, a few MB on disk (see the module docstring)."""
    return _write_full_size(Path(path), seed, text_frontend, _cheap_state)


def write_full_size_model(path: str | Path, seed: int = 0, text_frontend: bool = False) -> Path:
    """Released sizes with dense seeded random tensors (fp32), one file at a time (see the module docstring)."""
    return _write_full_size(Path(path), seed, text_frontend, _dense_state)


def _write_full_size(path: Path, seed: int, text_frontend: bool,
                     state_of: Callable[[torch.nn.Module, int], dict[str, torch.Tensor]]) -> Path:
    _write_configs(path, CosyVoice3Config())
    if text_frontend:
        _write_text_frontend(path, seed)
    for module, name, offset in zip(full_size_modules(), (LLM_FILE, FLOW_FILE, HIFT_FILE), range(3)):
        torch.save(state_of(module, seed + offset), path / name)
    return path


def _dense_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A dense random tensor per key of a meta-device module; tied parameters (the LLM's lm_head and text
    embedding) share one tensor, as `torch.save` of the real module stores them."""
    generator = torch.Generator().manual_seed(seed)
    first_name: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        alias[name] = first_name.setdefault(id(param), name)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        source = alias.get(name, name)
        if source != name:
            state[name] = state[source]
        elif tensor.is_floating_point():
            state[name] = torch.randn(tensor.shape, generator=generator) * 0.02
        else:
            state[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
    return state
