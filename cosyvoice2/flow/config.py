"""Flow (speech tokens -> mel) hyper-parameters; defaults are the released CosyVoice2-0.5B values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class ConformerEncoderShape:
    """What both upsampling conformer encoders (the UNet flow's and the DiT's) share. One width serves the
    embeddings, conformer layers, lookahead and upsampling."""

    width: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4  # fixed upstream, not a constructor argument
    pre_lookahead_len: int = 3
    upsample_stride: int = 2

    @property
    def head_dim(self) -> int:
        return self.width // self.attention_heads


@dataclass(frozen=True)
class EncoderConfig(ConformerEncoderShape):
    """UpsampleConformerEncoder: chunk-masked attention in streaming mode."""

    static_chunk_size: int = 25  # tokens; the up blocks use static_chunk_size * upsample_stride frames


@dataclass(frozen=True)
class EstimatorConfig:
    """Causal 1-D UNet (Matcha style) with a single channel level: no temporal down/upsampling."""

    in_channels: int = 320  # x, mu, speaker, cond: 4 x 80
    out_channels: int = 80
    channels: int = 256
    attention_head_dim: int = 64
    num_heads: int = 8
    n_blocks: int = 4  # transformer blocks per stage
    num_mid_blocks: int = 12
    static_chunk_size: int = 50  # frames

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.channels


@dataclass(frozen=True)
class CFMConfig:
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 15000  # longest flow call (prompt included) the fixed noise covers
    noise_seed: int = 0


@dataclass(frozen=True)
class FlowConfig:
    vocab_size: int = 6561
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    cfm: CFMConfig = field(default_factory=CFMConfig)

    @property
    def token_mel_ratio(self) -> int:
        return self.encoder.upsample_stride

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FlowConfig:
        """Inverse of dataclasses.asdict (for config override files)."""
        top = {k: v for k, v in data.items() if k not in ("encoder", "estimator", "cfm")}
        return cls(
            encoder=EncoderConfig(**data.get("encoder", {})),
            estimator=EstimatorConfig(**data.get("estimator", {})),
            cfm=CFMConfig(**data.get("cfm", {})),
            **top,
        )

    @classmethod
    def from_harness(cls, flow: Mapping[str, Any]) -> FlowConfig:
        """Build from the `flow` section of the parity harness config (upstream constructor arguments)."""
        enc, est, cfm = flow["encoder"], flow["estimator"], flow["decoder"]["cfm_params"]
        fixed = flow.get("encoder_fixed_layers", {})
        width = enc["output_size"]
        widths = {flow["input_size"], enc["input_size"], width}
        if "pre_lookahead_layer" in fixed:
            widths |= {fixed["pre_lookahead_layer"]["channels"], fixed["pre_lookahead_layer"]["in_channels"]}
        if "up_layer" in fixed:
            widths |= {fixed["up_layer"]["channels"], fixed["up_layer"]["out_channels"]}
        if len(widths) != 1:
            raise ValueError(f"flow encoder widths must all be equal, got {sorted(widths)}")
        if len(est["channels"]) != 1:
            raise ValueError(f"only a single-level estimator is supported, got channels={est['channels']}")
        if flow["token_mel_ratio"] != fixed.get("up_layer", {}).get("stride", flow["token_mel_ratio"]):
            raise ValueError("token_mel_ratio must equal the encoder upsample stride")
        return cls(
            vocab_size=flow["vocab_size"],
            output_size=flow["output_size"],
            spk_embed_dim=flow["spk_embed_dim"],
            encoder=EncoderConfig(
                width=width,
                attention_heads=enc["attention_heads"],
                linear_units=enc["linear_units"],
                num_blocks=enc["num_blocks"],
                static_chunk_size=enc["static_chunk_size"],
                pre_lookahead_len=flow["pre_lookahead_len"],
                upsample_stride=flow["token_mel_ratio"],
            ),
            estimator=EstimatorConfig(
                in_channels=est["in_channels"],
                out_channels=est["out_channels"],
                channels=est["channels"][0],
                attention_head_dim=est["attention_head_dim"],
                num_heads=est["num_heads"],
                n_blocks=est["n_blocks"],
                num_mid_blocks=est["num_mid_blocks"],
                static_chunk_size=est["static_chunk_size"],
            ),
            cfm=CFMConfig(inference_cfg_rate=cfm["inference_cfg_rate"]),
        )
