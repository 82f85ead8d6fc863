"""DiT token2wav hyper-parameters; defaults are the released Step-Audio-2-mini `token2wav/flow.yaml` values.

`DiTFlowConfig.from_flow_yaml` reads a `flow.yaml` in the released layout (HyperPyYAML with `!new:` class tags):
the tags are only checked by class name and their arguments are read as plain mappings, so nothing in the file
is imported or executed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..flow.config import ConformerEncoderShape

# Class names the released flow.yaml instantiates, per section (checked so that a UNet flow.yaml is refused).
_FLOW_CLASS = "CausalMaskedDiffWithXvec"
_ENCODER_CLASS = "UpsampleConformerEncoderV2"
_CFM_CLASS = "CausalConditionalCFM"
_ESTIMATOR_CLASS = "DiT"


class DiTConfigError(ValueError):
    """A flow.yaml or config mapping that does not describe a DiT token2wav this engine implements."""


@dataclass(frozen=True)
class DiTEncoderConfig(ConformerEncoderShape):
    """UpsampleConformerEncoderV2: the UNet flow encoder's shape, unmasked attention whose keys/values a stream
    caches."""

    max_positions: int = 5000  # the ESPnet relative-position table: cache + chunk must stay below it


@dataclass(frozen=True)
class DiTEstimatorConfig:
    """The DiT velocity estimator (adaLN-Zero, QK-norm attention, causal conv block per layer)."""

    in_channels: int = 320  # x, mu, speaker, cond: 4 x 80
    out_channels: int = 80
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0
    frequency_embedding_size: int = 256
    conv_kernel: int = 3

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class DiTSolverConfig:
    """Euler solver and the streaming attention window."""

    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 30000  # the fixed noise buffer (600 s at 50 Hz)
    noise_seed: int = 0  # the released runtime draws it unseeded per process; we seed it for reproducibility
    window_extra_frames: int = 100  # estimator K/V kept after a chunk: prompt frames + this many


@dataclass(frozen=True)
class DiTFlowConfig:
    vocab_size: int = 6561
    input_size: int = 512  # token embedding width (= encoder width)
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    encoder: DiTEncoderConfig = field(default_factory=DiTEncoderConfig)
    estimator: DiTEstimatorConfig = field(default_factory=DiTEstimatorConfig)
    solver: DiTSolverConfig = field(default_factory=DiTSolverConfig)

    def __post_init__(self) -> None:
        if self.input_size != self.encoder.width:
            raise DiTConfigError(f"token embedding width {self.input_size} must equal the encoder width "
                                 f"{self.encoder.width}")
        if self.estimator.in_channels != 4 * self.output_size:
            raise DiTConfigError(f"estimator in_channels {self.estimator.in_channels} must be 4 x {self.output_size}")
        if self.estimator.out_channels != self.output_size:
            raise DiTConfigError("estimator out_channels must equal the mel bins")

    @property
    def token_mel_ratio(self) -> int:
        return self.encoder.upsample_stride

    @property
    def pre_lookahead_len(self) -> int:
        return self.encoder.pre_lookahead_len

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DiTFlowConfig":
        """Inverse of `to_dict`."""
        top = {k: v for k, v in data.items() if k not in ("encoder", "estimator", "solver")}
        return cls(encoder=DiTEncoderConfig(**data.get("encoder", {})),
                   estimator=DiTEstimatorConfig(**data.get("estimator", {})),
                   solver=DiTSolverConfig(**data.get("solver", {})), **top)

    def to_flow_yaml(self) -> str:
        """A flow.yaml in the released layout (classes and argument names) for this config."""
        e, d = self.encoder, self.estimator
        return f"""# DiT token2wav flow (released Step-Audio-2-mini token2wav/flow.yaml layout)
flow: !new:cosyvoice2.flow.flow.{_FLOW_CLASS}
    input_size: {self.input_size}
    output_size: {self.output_size}
    spk_embed_dim: {self.spk_embed_dim}
    output_type: 'mel'
    vocab_size: {self.vocab_size}
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.{_ENCODER_CLASS}
        input_size: {e.width}
        output_size: {e.width}
        input_layer: 'linear'
        pre_lookahead_len: {e.pre_lookahead_len}
        num_blocks: {e.num_blocks}
        num_up_blocks: {e.num_up_blocks}
        up_stride: {e.upsample_stride}
        up_scale_factor: {e.upsample_stride}
        attention_heads: {e.attention_heads}
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: True
        linear_units: {e.linear_units}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
    decoder: !new:cosyvoice2.flow.flow_matching.{_CFM_CLASS}
        inference_cfg_rate: {self.solver.inference_cfg_rate}
        estimator: !new:cosyvoice2.flow.decoder_dit.{_ESTIMATOR_CLASS}
            in_channels: {d.in_channels}
            out_channels: {d.out_channels}
            mlp_ratio: {d.mlp_ratio}
            depth: {d.depth}
            num_heads: {d.num_heads}
            head_dim: {d.head_dim}
            hidden_size: {d.hidden_size}
"""

    @classmethod
    def from_flow_yaml(cls, source: str | Path, solver: DiTSolverConfig | None = None) -> "DiTFlowConfig":
        """Parse a released-layout `flow.yaml` (a path or its text)."""
        text = Path(source).read_text() if isinstance(source, Path) else source
        return cls.from_constructor_args(_load_tagged_yaml(text)["flow"], solver)

    @classmethod
    def from_constructor_args(cls, flow: Mapping[str, Any], solver: DiTSolverConfig | None = None) -> "DiTFlowConfig":
        """Build from the upstream constructor arguments (`flow` of flow.yaml, or the parity harness config)."""
        _check_class(flow, _FLOW_CLASS, "flow")
        if flow.get("output_type", "mel") != "mel":
            raise DiTConfigError(f"output_type must be 'mel', got {flow['output_type']!r}")
        enc, cfm = flow["encoder"], flow["decoder"]
        _check_class(enc, _ENCODER_CLASS, "flow.encoder")
        _check_class(cfm, _CFM_CLASS, "flow.decoder")
        est = cfm.get("estimator")
        if est is None:  # the parity harness lists the estimator beside the decoder
            est = flow["estimator"]
        _check_class(est, _ESTIMATOR_CLASS, "flow.decoder.estimator")
        expected = {"input_layer": "linear", "pos_enc_layer_type": "rel_pos_espnet",
                    "selfattention_layer_type": "rel_selfattn", "key_bias": True, "normalize_before": True}
        for key, value in expected.items():
            if enc.get(key, value) != value:
                raise DiTConfigError(f"flow.encoder.{key} = {enc[key]!r} is not supported (only {value!r})")
        if enc["input_size"] != enc["output_size"]:
            raise DiTConfigError("flow.encoder input_size and output_size must be equal")
        if float(enc.get("up_scale_factor", enc["up_stride"])) != float(enc["up_stride"]):
            raise DiTConfigError("flow.encoder up_scale_factor must equal up_stride")
        base = solver or DiTSolverConfig()
        return cls(
            vocab_size=int(flow["vocab_size"]),
            input_size=int(flow["input_size"]),
            output_size=int(flow["output_size"]),
            spk_embed_dim=int(flow["spk_embed_dim"]),
            encoder=DiTEncoderConfig(
                width=int(enc["output_size"]), attention_heads=int(enc["attention_heads"]),
                linear_units=int(enc["linear_units"]), num_blocks=int(enc["num_blocks"]),
                num_up_blocks=int(enc["num_up_blocks"]), pre_lookahead_len=int(enc["pre_lookahead_len"]),
                upsample_stride=int(enc["up_stride"])),
            estimator=DiTEstimatorConfig(
                in_channels=int(est["in_channels"]), out_channels=int(est["out_channels"]),
                hidden_size=int(est["hidden_size"]), depth=int(est["depth"]), num_heads=int(est["num_heads"]),
                head_dim=int(est["head_dim"]), mlp_ratio=float(est["mlp_ratio"])),
            solver=DiTSolverConfig(**{**asdict(base), "inference_cfg_rate": float(cfm["inference_cfg_rate"])}),
        )


def _check_class(section: Mapping[str, Any], name: str, where: str) -> None:
    tag = section.get("__class__")
    if tag is not None and tag.rsplit(".", 1)[-1] != name:
        raise DiTConfigError(f"{where} is {tag}, expected a {name}")


def _load_tagged_yaml(text: str, top: str = "flow") -> dict[str, Any]:
    """yaml.safe_load that turns `!new:pkg.Class` mappings into dicts with a `__class__` entry."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def construct_new(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
        if not isinstance(node, yaml.MappingNode):
            raise DiTConfigError(f"!new:{suffix} must tag a mapping of constructor arguments")
        return {"__class__": suffix, **loader.construct_mapping(node, deep=True)}

    Loader.add_multi_constructor("!new:", construct_new)
    data = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass with one data-only constructor
    if not isinstance(data, dict) or top not in data:
        raise DiTConfigError(f"the YAML file has no top-level {top!r} entry")
    return data
