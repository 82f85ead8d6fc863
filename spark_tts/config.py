"""Typed hyper-parameters of Spark-TTS-0.5B, read from the released directory's YAML/JSON files.

Defaults are the released model's values (docs/spark.md, "Released checkpoint"); the files override them, so the
same classes describe the released model and the tiny test models. Widths that the released code hard-codes
instead of configuring (ECAPA trunk channels, pooling bottleneck, ...) are read from the checkpoint by
``spark_tts.loading``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml

from spark_tts.errors import SparkModelError

T = TypeVar("T")


def _from_mapping(cls: type[T], values: Mapping[str, Any] | None) -> T:
    """Build a dataclass from a mapping, ignoring keys it does not declare (training-only options)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    picked = {}
    for key, value in (values or {}).items():
        if key in names:
            picked[key] = tuple(value) if isinstance(value, list) else value
    return cls(**picked)


@dataclass(frozen=True)
class MelParams:
    """Magnitude mel spectrogram of the speaker reference clip (torchaudio ``MelSpectrogram`` semantics)."""

    sample_rate: int = 16000
    n_fft: int = 1024
    win_length: int = 640
    hop_length: int = 320
    mel_fmin: float = 10.0
    mel_fmax: float | None = None  # None: sample_rate / 2
    num_mels: int = 128


@dataclass(frozen=True)
class EncoderParams:
    """Semantic feature encoder (wav2vec2 features -> latent at 50 Hz)."""

    input_channels: int = 1024
    vocos_dim: int = 384
    vocos_intermediate_dim: int = 2048
    vocos_num_layers: int = 12
    out_channels: int = 1024
    sample_ratios: tuple[int, ...] = (1, 1)


@dataclass(frozen=True)
class FeatDecoderParams:
    """Prenet (conditioned on the d-vector) and postnet: ConvNeXt stacks at the token rate."""

    input_channels: int = 1024
    vocos_dim: int = 384
    vocos_intermediate_dim: int = 2048
    vocos_num_layers: int = 12
    out_channels: int = 1024
    condition_dim: int | None = None
    sample_ratios: tuple[int, ...] = (1, 1)
    use_tanh_at_final: bool = False


@dataclass(frozen=True)
class QuantizerParams:
    """Factorized VQ of the semantic stream: 1x1 projection to ``codebook_dim``, cosine nearest code."""

    input_dim: int = 1024
    codebook_size: int = 8192
    codebook_dim: int = 8


@dataclass(frozen=True)
class SpeakerParams:
    """Global stream: ECAPA-TDNN features -> Perceiver -> FSQ tokens; tokens -> d-vector."""

    input_dim: int = 128
    out_dim: int = 1024
    latent_dim: int = 128
    token_num: int = 32
    fsq_levels: tuple[int, ...] = (4, 4, 4, 4, 4, 4)
    fsq_num_quantizers: int = 1


@dataclass(frozen=True)
class WaveParams:
    """DAC-style wave generator: ``prod(rates)`` samples per token."""

    input_channel: int = 1024
    channels: int = 1536
    rates: tuple[int, ...] = (8, 5, 4, 2)
    kernel_sizes: tuple[int, ...] = (16, 11, 8, 4)


@dataclass(frozen=True)
class BiCodecConfig:
    mel: MelParams = field(default_factory=MelParams)
    encoder: EncoderParams = field(default_factory=EncoderParams)
    quantizer: QuantizerParams = field(default_factory=QuantizerParams)
    speaker: SpeakerParams = field(default_factory=SpeakerParams)
    prenet: FeatDecoderParams = field(default_factory=lambda: FeatDecoderParams(condition_dim=1024))
    postnet: FeatDecoderParams = field(default_factory=lambda: FeatDecoderParams(vocos_num_layers=6))
    decoder: WaveParams = field(default_factory=WaveParams)

    @property
    def hop_length(self) -> int:
        """Waveform samples per semantic token."""
        hop = 1
        for rate in self.decoder.rates:
            hop *= rate
        return hop

    @classmethod
    def from_yaml(cls, path: Path) -> "BiCodecConfig":
        """``BiCodec/config.yaml`` (section ``audio_tokenizer``)."""
        data = _read_yaml(path)
        section = data.get("audio_tokenizer")
        if not isinstance(section, Mapping):
            raise SparkModelError(f"{path}: no 'audio_tokenizer' section")
        return cls(
            mel=_from_mapping(MelParams, section.get("mel_params")),
            encoder=_from_mapping(EncoderParams, section.get("encoder")),
            quantizer=_from_mapping(QuantizerParams, section.get("quantizer")),
            speaker=_from_mapping(SpeakerParams, section.get("speaker_encoder")),
            prenet=_from_mapping(FeatDecoderParams, section.get("prenet")),
            postnet=_from_mapping(FeatDecoderParams, section.get("postnet")),
            decoder=_from_mapping(WaveParams, section.get("decoder")),
        )

    def to_yaml_dict(self) -> dict[str, Any]:
        """The ``audio_tokenizer`` section as the released file spells it (for writing test models)."""

        def plain(obj: Any) -> dict[str, Any]:
            return {f.name: list(v) if isinstance(v := getattr(obj, f.name), tuple) else v for f in fields(obj)}

        mel = plain(self.mel)
        return {"audio_tokenizer": {
            "mel_params": mel, "encoder": plain(self.encoder), "decoder": plain(self.decoder),
            "quantizer": plain(self.quantizer), "speaker_encoder": plain(self.speaker),
            "prenet": plain(self.prenet), "postnet": plain(self.postnet),
        }}


@dataclass(frozen=True)
class AudioParams:
    """Top-level ``config.yaml``: how reference audio is prepared."""

    sample_rate: int = 16000
    highpass_cutoff_freq: int = 40
    latent_hop_length: int = 320
    ref_segment_duration: float = 6
    volume_normalize: bool = True

    @property
    def ref_segment_length(self) -> int:
        """Samples of the speaker reference clip: the duration rounded down to whole latent hops (96,000)."""
        return int(self.sample_rate * self.ref_segment_duration) // self.latent_hop_length * self.latent_hop_length

    @classmethod
    def from_yaml(cls, path: Path) -> "AudioParams":
        return _from_mapping(cls, _read_yaml(path))


@dataclass(frozen=True)
class Wav2Vec2Params:
    """The wav2vec2 (stable layer norm) fields our feature extractor needs, from its ``config.json``."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    conv_dim: tuple[int, ...] = (512,) * 7
    conv_kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    conv_stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    conv_bias: bool = True
    num_conv_pos_embeddings: int = 128
    num_conv_pos_embedding_groups: int = 16
    layer_norm_eps: float = 1e-5
    do_stable_layer_norm: bool = True
    feat_extract_norm: str = "layer"
    hidden_act: str = "gelu"
    feat_extract_activation: str = "gelu"
    # pretraining heads present in the released file (unused by Spark, checked by the strict loader)
    num_codevector_groups: int = 2
    num_codevectors_per_group: int = 320
    codevector_dim: int = 768
    proj_codevector_dim: int = 768

    @classmethod
    def from_json(cls, path: Path) -> "Wav2Vec2Params":
        params = _from_mapping(cls, json.loads(path.read_text()))
        if not params.do_stable_layer_norm or params.feat_extract_norm != "layer":
            raise SparkModelError(f"{path}: only the stable-layer-norm wav2vec2 (xlsr-53 family) is supported")
        if params.hidden_act != "gelu" or params.feat_extract_activation != "gelu":
            raise SparkModelError(f"{path}: only gelu activations are supported")
        return params

    @property
    def min_samples(self) -> int:
        """Fewest samples that give one frame: the conv front end's receptive field (400 released)."""
        field, hop = 1, 1
        for kernel, stride in zip(self.conv_kernel, self.conv_stride):
            field += (kernel - 1) * hop
            hop *= stride
        return field

    def frames(self, samples: int) -> int:
        """Feature frames the conv front end yields for ``samples`` input samples (0 if too short)."""
        length = samples
        for kernel, stride in zip(self.conv_kernel, self.conv_stride):
            length = (length - kernel) // stride + 1 if length >= kernel else 0
        return length


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise SparkModelError(f"{path} is missing") from exc
    if not isinstance(data, dict):
        raise SparkModelError(f"{path}: expected a mapping")
    return data


def as_tuple(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)
