"""Strict loading of a Spark-TTS model directory in the released layout (``spark_tts.layout``).

Every checkpoint is matched key by key and shape by shape against what our modules expect in the *released
serialisation* (weight-normed layers as ``weight_g``/``weight_v``, wav2vec2 under ``wav2vec2.`` with its
pretraining heads, a tied LLM head absent); a file with a missing, extra or mis-shaped tensor is rejected with
every difference listed. ``released_*_shapes`` give those expected manifests without loading anything (the
full-size layout test uses them on the meta device).

Widths the released code hard-codes instead of configuring (the ECAPA trunk, its pooling and squeeze-excitation
bottlenecks, the ECAPA feature width) are read from the BiCodec checkpoint's shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from speech_lm.qwen2 import Qwen2Config, Qwen2ForCausalLM
from speech_lm.checkpoints import CheckpointMismatchError, check_state_dict, meta_without_init
from spark_tts import layout
from spark_tts.codec.bicodec import BiCodec
from spark_tts.codec.layers import fold_weight_norm
from spark_tts.codec.speaker import EcapaWidths
from spark_tts.codec.wav2vec2 import Wav2Vec2Features
from spark_tts.config import AudioParams, BiCodecConfig, Wav2Vec2Params
from spark_tts.errors import SparkModelError
from spark_tts.llm import SparkLM, SparkLMConfig, SparkSampling
from spark_tts.prompt import SparkTokenizer

Shapes = dict[str, tuple[int, ...]]

#: Prefix of the wav2vec2 body's keys in the released file (Wav2Vec2ForPreTraining); its heads have none.
_W2V_PREFIX = "wav2vec2."


def check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise SparkModelError(f"model directory {model_dir} does not exist")
    missing = [name for name in layout.MODEL_FILES if not (model_dir / name).is_file()]
    if missing:
        raise SparkModelError(f"model directory {model_dir} lacks {', '.join(missing)}")


def _check(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], path: Path) -> None:
    as_tensors = {k: torch.empty(v, device="meta") for k, v in expected.items()}
    found_tensors = {k: torch.empty(v, device="meta") for k, v in found.items()}
    try:
        check_state_dict(as_tensors, found_tensors, path)
    except CheckpointMismatchError as exc:
        raise SparkModelError(str(exc)) from exc


def _weight_norm_shapes(state: Mapping[str, tuple[int, ...]], layers: list[str]) -> Shapes:
    """A module's shapes with each weight-normed layer's ``weight`` split into ``weight_g``/``weight_v``."""
    out = dict(state)
    for layer in layers:
        shape = out.pop(f"{layer}.weight")
        out[f"{layer}.weight_g"] = (shape[0],) + (1,) * (len(shape) - 1)
        out[f"{layer}.weight_v"] = shape
    return out


def _fold(state: dict[str, torch.Tensor], layers: list[str]) -> dict[str, torch.Tensor]:
    for layer in layers:
        state[f"{layer}.weight"] = fold_weight_norm(state.pop(f"{layer}.weight_g"), state.pop(f"{layer}.weight_v"))
    return state


def _shapes(module: nn.Module) -> Shapes:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


# ---- BiCodec --------------------------------------------------------------------------------------------------
def ecapa_widths(shapes: Mapping[str, tuple[int, ...]]) -> EcapaWidths:
    prefix = "speaker_encoder.speaker_encoder."
    try:
        return EcapaWidths(
            channels=shapes[f"{prefix}layer1.conv.weight"][0],
            latent_channels=shapes[f"{prefix}conv.weight"][0],
            pool_bottleneck=shapes[f"{prefix}pool.linear1.weight"][0],
            se_bottleneck=shapes[f"{prefix}layer2.se_res2block.3.linear1.weight"][0],
        )
    except KeyError as exc:
        raise SparkModelError(f"BiCodec checkpoint lacks {exc.args[0]}") from exc


def released_bicodec_shapes(config: BiCodecConfig, widths: EcapaWidths) -> Shapes:
    with meta_without_init():
        model = BiCodec(config, widths)
    return _weight_norm_shapes(_shapes(model), model.weight_normed())


def load_bicodec(model_dir: Path, device: torch.device | str = "cpu") -> BiCodec:
    config = BiCodecConfig.from_yaml(model_dir / layout.BICODEC_CONFIG_FILE)
    path = model_dir / layout.BICODEC_WEIGHTS_FILE
    state = load_file(path)
    widths = ecapa_widths({k: tuple(v.shape) for k, v in state.items()})
    _check(released_bicodec_shapes(config, widths), {k: tuple(v.shape) for k, v in state.items()}, path)
    model = BiCodec(config, widths)  # small enough to build normally; its mel window/filterbank are computed
    model.load_state_dict(_fold(state, model.weight_normed()), strict=True)
    return model.to(device).eval()


# ---- wav2vec2 -------------------------------------------------------------------------------------------------
def released_wav2vec2_shapes(p: Wav2Vec2Params) -> Shapes:
    """``pytorch_model.bin`` of wav2vec2-large-xlsr-53 (Wav2Vec2ForPreTraining): every layer, the final encoder
    LayerNorm, ``masked_spec_embed``, the positional conv as ``weight_g`` (per kernel tap) / ``weight_v``, and the
    pretraining heads."""
    with meta_without_init():
        model = Wav2Vec2Features(p)
        # the file holds every layer, not only those the feature mix reads
        model.encoder.layers = nn.ModuleList(type(model.encoder.layers[0])(p) for _ in range(p.num_hidden_layers))
    body = _shapes(model)
    conv = body.pop("encoder.pos_conv_embed.conv.weight")
    body["encoder.pos_conv_embed.conv.weight_g"] = (1, 1, conv[2])
    body["encoder.pos_conv_embed.conv.weight_v"] = conv
    body["encoder.layer_norm.weight"] = body["encoder.layer_norm.bias"] = (p.hidden_size,)
    body["masked_spec_embed"] = (p.hidden_size,)
    shapes = {_W2V_PREFIX + k: v for k, v in body.items()}
    codevectors = p.num_codevector_groups * p.num_codevectors_per_group
    shapes.update({
        "quantizer.codevectors": (1, codevectors, p.codevector_dim // p.num_codevector_groups),
        "quantizer.weight_proj.weight": (codevectors, p.conv_dim[-1]),
        "quantizer.weight_proj.bias": (codevectors,),
        "project_q.weight": (p.proj_codevector_dim, p.codevector_dim),
        "project_q.bias": (p.proj_codevector_dim,),
        "project_hid.weight": (p.proj_codevector_dim, p.hidden_size),
        "project_hid.bias": (p.proj_codevector_dim,),
    })
    return shapes


def load_wav2vec2(model_dir: Path, device: torch.device | str = "cpu") -> Wav2Vec2Features:
    params = Wav2Vec2Params.from_json(model_dir / layout.WAV2VEC2_CONFIG_FILE)
    path = model_dir / layout.WAV2VEC2_WEIGHTS_FILE
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    _check(released_wav2vec2_shapes(params), {k: tuple(v.shape) for k, v in state.items()}, path)
    with meta_without_init():
        model = Wav2Vec2Features(params)
    wanted = {}
    for key in model.state_dict():
        if key == "encoder.pos_conv_embed.conv.weight":
            g = state[_W2V_PREFIX + "encoder.pos_conv_embed.conv.weight_g"]
            v = state[_W2V_PREFIX + "encoder.pos_conv_embed.conv.weight_v"]
            # weight norm over the kernel axis: the norm runs over dims 0 and 1, per tap
            wanted[key] = g * v / v.norm(dim=(0, 1), keepdim=True)
        else:
            wanted[key] = state[_W2V_PREFIX + key]
    model.load_state_dict(wanted, strict=True, assign=True)
    return model.to(device).eval()


# ---- LLM ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLMFileConfig:
    qwen: Qwen2Config
    tied: bool


def read_llm_config(model_dir: Path) -> LLMFileConfig:
    path = model_dir / layout.LLM_CONFIG_FILE
    values = json.loads(path.read_text())
    try:
        qwen = Qwen2Config.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise SparkModelError(f"{path}: {exc}") from exc
    return LLMFileConfig(qwen=qwen, tied=bool(values.get("tie_word_embeddings", False)))


def released_llm_shapes(config: LLMFileConfig) -> Shapes:
    with meta_without_init():
        model = Qwen2ForCausalLM(config.qwen)
    shapes = _shapes(model)
    if config.tied:
        shapes.pop("lm_head.weight")  # one tensor in the file, shared with the embedding
    return shapes


def read_llm_state(model_dir: Path, config: LLMFileConfig) -> dict[str, torch.Tensor]:
    path = model_dir / layout.LLM_WEIGHTS_FILE
    with safe_open(str(path), framework="pt") as handle:
        found = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
    _check(released_llm_shapes(config), found, path)
    return load_file(path)


def read_audio_params(model_dir: Path) -> AudioParams:
    return AudioParams.from_yaml(model_dir / layout.AUDIO_CONFIG_FILE)


def load_llm(model_dir: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             sampling: SparkSampling | None = None) -> SparkLM:
    config = read_llm_config(model_dir)
    state = read_llm_state(model_dir, config)
    eos_id = SparkTokenizer.from_model_dir(model_dir).vocab.eos_id
    with meta_without_init():
        model = SparkLM(SparkLMConfig(qwen=config.qwen, eos_id=eos_id, sampling=sampling or SparkSampling()))
    model.load_released(state, config.tied)
    return model.to(device=device, dtype=dtype).eval()
