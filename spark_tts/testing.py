"""Tiny random Spark-TTS model directories in the released layout, for tests and CI stacks (no download).

``write_tiny_model(dir, seed)`` writes every file ``SparkTTS.load`` reads, in the released serialisation
(weight-normed layers as ``weight_g``/``weight_v``, wav2vec2 under ``wav2vec2.`` with all its layers and
pretraining heads, a tied LLM head), at small widths, with seeded random weights (not speech). The tokenizer is a
byte-level BPE stand-in (``speech_lm.testing``'s byte alphabet and merges) with Qwen2's three
base specials and all of Spark's added tokens; its ids differ from the release's, which the engine never
hard-codes.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from spark_tts import layout
from spark_tts.codec.bicodec import BiCodec
from spark_tts.codec.speaker import EcapaWidths
from spark_tts.codec.wav2vec2 import Wav2Vec2Features
from spark_tts.config import (
    AudioParams,
    BiCodecConfig,
    EncoderParams,
    FeatDecoderParams,
    QuantizerParams,
    SpeakerParams,
    Wav2Vec2Params,
    WaveParams,
)
from spark_tts.loading import released_wav2vec2_shapes
from spark_tts.prompt import (
    END_CONTENT,
    END_GLOBAL,
    NUM_GLOBAL_CODES,
    NUM_SEMANTIC_CODES,
    START_CONTENT,
    START_GLOBAL,
    START_SEMANTIC,
    TASK_TTS,
    global_token,
    semantic_token,
)
from speech_lm.qwen2 import Qwen2Config, Qwen2ForCausalLM
from speech_lm.testing import BASE_SPECIAL_TOKENS, write_test_tokenizer

TINY_WIDTH = 32


def tiny_bicodec_config() -> BiCodecConfig:
    w = TINY_WIDTH
    return BiCodecConfig(
        encoder=EncoderParams(input_channels=w, vocos_dim=16, vocos_intermediate_dim=32, vocos_num_layers=2,
                              out_channels=w),
        quantizer=QuantizerParams(input_dim=w),
        speaker=SpeakerParams(out_dim=w, latent_dim=16),
        prenet=FeatDecoderParams(input_channels=w, vocos_dim=16, vocos_intermediate_dim=32, vocos_num_layers=2,
                                 out_channels=w, condition_dim=w),
        postnet=FeatDecoderParams(input_channels=w, vocos_dim=16, vocos_intermediate_dim=32, vocos_num_layers=1,
                                  out_channels=w),
        decoder=WaveParams(input_channel=w, channels=w),
    )


TINY_WIDTHS = EcapaWidths(channels=16, latent_channels=48, pool_bottleneck=8, se_bottleneck=8)
TINY_WAV2VEC2 = Wav2Vec2Params(hidden_size=TINY_WIDTH, num_hidden_layers=17, num_attention_heads=4,
                               intermediate_size=64, conv_dim=(TINY_WIDTH,) * 7, num_codevectors_per_group=8,
                               codevector_dim=16, proj_codevector_dim=16)
RELEASED_QWEN = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     max_position_embeddings=32768)
RELEASED_VOCAB = 166_000
TINY_QWEN = dict(hidden_size=TINY_WIDTH, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32768)

SPARK_ADDED_TOKENS = (
    *(global_token(i) for i in range(NUM_GLOBAL_CODES)),
    *(semantic_token(i) for i in range(NUM_SEMANTIC_CODES)),
    "<|task_vc|>", TASK_TTS, START_CONTENT, END_CONTENT, START_GLOBAL, END_GLOBAL, START_SEMANTIC,
)


def _weight_norm_split(state: dict[str, torch.Tensor], layers: list[str]) -> dict[str, torch.Tensor]:
    for layer in layers:
        weight = state.pop(f"{layer}.weight")
        g = weight.norm(dim=tuple(range(1, weight.dim())), keepdim=True)
        state[f"{layer}.weight_g"], state[f"{layer}.weight_v"] = g, weight.clone()
    return state


def _write_bicodec(directory: Path, full_size: bool = False) -> None:
    config = BiCodecConfig() if full_size else tiny_bicodec_config()
    model = BiCodec(config, EcapaWidths() if full_size else TINY_WIDTHS)
    with torch.no_grad():  # random BatchNorm statistics, so a misplaced norm shows
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
        model.speaker_encoder.perceiver_sampler.latents.normal_()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    (directory / layout.BICODEC_DIR).mkdir(parents=True, exist_ok=True)
    save_file(_weight_norm_split(state, model.weight_normed()), directory / layout.BICODEC_WEIGHTS_FILE)
    (directory / layout.BICODEC_CONFIG_FILE).write_text(yaml.safe_dump(config.to_yaml_dict(), sort_keys=False))


def _write_wav2vec2(directory: Path, full_size: bool = False) -> None:
    p = Wav2Vec2Params() if full_size else TINY_WAV2VEC2
    model = Wav2Vec2Features(p)
    used = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for key, shape in released_wav2vec2_shapes(p).items():
        short = key.removeprefix("wav2vec2.")
        if short in used:
            state[key] = used[short].detach().clone()
        elif key.endswith("layer_norm.weight"):
            state[key] = torch.ones(shape)
        else:
            state[key] = 0.05 * torch.randn(shape)
    conv = used["encoder.pos_conv_embed.conv.weight"]
    state["wav2vec2.encoder.pos_conv_embed.conv.weight_g"] = conv.norm(dim=(0, 1), keepdim=True)
    state["wav2vec2.encoder.pos_conv_embed.conv.weight_v"] = conv.detach().clone()
    out = directory / layout.WAV2VEC2_DIR
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / "pytorch_model.bin")
    config = {**asdict(p), "architectures": ["Wav2Vec2ForPreTraining"], "model_type": "wav2vec2"}
    (directory / layout.WAV2VEC2_CONFIG_FILE).write_text(json.dumps(config, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "do_normalize": True, "feature_extractor_type": "Wav2Vec2FeatureExtractor", "feature_size": 1,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 16000}))


def _write_tokenizer(llm_dir: Path) -> Tokenizer:
    write_test_tokenizer(llm_dir)
    tokenizer = Tokenizer(models.BPE.from_file(str(llm_dir / "vocab.json"), str(llm_dir / "merges.txt")))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BASE_SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPARK_ADDED_TOKENS])
    tokenizer.save(str(llm_dir / "tokenizer.json"))
    return tokenizer


def _write_llm(directory: Path, full_size: bool = False, dtype: torch.dtype = torch.float32) -> None:
    llm_dir = directory / layout.LLM_DIR
    tokenizer = _write_tokenizer(llm_dir)
    # padded, as the release pads (its vocabulary: 166,000 rows)
    vocab_size = RELEASED_VOCAB if full_size else -(-tokenizer.get_vocab_size(with_added_tokens=True) // 64) * 64
    dims = RELEASED_QWEN if full_size else TINY_QWEN
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab_size, **dims))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, dims["hidden_size"] ** -0.5)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, directory / layout.LLM_WEIGHTS_FILE)
    config = {**dims, "vocab_size": vocab_size, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "hidden_act": "silu", "tie_word_embeddings": True, "use_sliding_window": False,
              "torch_dtype": str(dtype).removeprefix("torch."), "eos_token_id": tokenizer.token_to_id("<|im_end|>")}
    (directory / layout.LLM_CONFIG_FILE).write_text(json.dumps(config, indent=1))


def write_tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Spark-TTS model directory (released layout) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _write_bicodec(directory)
        _write_wav2vec2(directory)
        _write_llm(directory)
    (directory / layout.AUDIO_CONFIG_FILE).write_text(yaml.safe_dump(asdict(AudioParams()), sort_keys=False))
    return directory


def write_full_size_random_model(directory: str | Path, seed: int = 0, llm_dtype: torch.dtype = torch.bfloat16
                                 ) -> Path:
    """Released sizes with random weights (BiCodec and wav2vec2 fp32, the LLM in ``llm_dtype``: ~2.9 GB in
    bf16), for speed checks on a GPU. The tokenizer is the tiny stand-in (its ids fit the 166,000 rows)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _write_bicodec(directory, full_size=True)
        _write_wav2vec2(directory, full_size=True)
        _write_llm(directory, full_size=True, dtype=llm_dtype)
    (directory / layout.AUDIO_CONFIG_FILE).write_text(yaml.safe_dump(asdict(AudioParams()), sort_keys=False))
    return directory
