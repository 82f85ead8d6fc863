"""CosyVoice3 hyper-parameters, read from a released model directory (torch-free).

A release holds `cosyvoice3.yaml` (HyperPyYAML: `!new:` class tags with constructor arguments, `!ref` references,
`!name:` / `!apply:` entries for the frontend and data pipeline) and `CosyVoice-BlankEN/config.json` (the Qwen2
body). `read_release_yaml` parses the YAML as data only: tags become mappings with a `__class__` entry, `!ref`
expressions are resolved against the top-level keys (plain arithmetic only), and nothing is imported or run.
Defaults are the released Fun-CosyVoice3-0.5B-2512 values.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from cosyvoice2.hift.config import HiFTConfig
from cosyvoice2.llm.config import LLMConfig
from speech_lm.config import Qwen2Config

from .errors import CosyVoice3ConfigError
from .layout import MODEL_YAML, QWEN_CONFIG

#: Class names the released yaml instantiates (checked by their last dotted component).
LLM_CLASS = "CosyVoice3LM"
FLOW_CLASS = "CausalMaskedDiffWithDiT"
LOOKAHEAD_CLASS = "PreLookaheadLayer"
CFM_CLASS = "CausalConditionalCFM"
DIT_CLASS = "DiT"
HIFT_CLASS = "CausalHiFTGenerator"
F0_CLASS = "CausalConvRNNF0Predictor"

#: `<|endofprompt|>` in the CosyVoice3 tokenizer: the LLM refuses a text without it.
ENDOFPROMPT_ID = 151646
#: The system prompt every CosyVoice3 text starts with (the frontend adds it where it is missing).
SYSTEM_PROMPT = "You are a helpful assistant."
ENDOFPROMPT = "<|endofprompt|>"


@dataclass(frozen=True)
class RASConfig:
    """Repetition-aware nucleus sampling (the yaml's `llm.sampling`)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class CosyVoice3LLMConfig(LLMConfig):
    """CosyVoice3LM: the CosyVoice2 Qwen2 body with a 6561 + 200 speech vocabulary whose special ids (sos, eos,
    task, fill, then 196 unused) live inside it; the decoder has no bias and no separate sos/task embedding."""

    num_special_tokens: int = 200
    endofprompt_id: int = ENDOFPROMPT_ID
    sampling: RASConfig = field(default_factory=RASConfig)
    #: more than this many consecutive silent/breath tokens are dropped from the generated stream
    max_silent_run: int = 5
    silent_tokens: tuple[int, ...] = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)

    @property
    def num_speech_classes(self) -> int:
        return self.speech_token_size + self.num_special_tokens

    @property
    def sos_id(self) -> int:
        return self.speech_token_size

    @property
    def eos_id(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill_id(self) -> int:
        return self.speech_token_size + 3

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every special id ends decoding. The one id masked below the minimum length stays index
        `speech_token_size` (`LLMConfig.vocabulary`), which in this vocabulary is sos rather than eos: the
        reference masks that index, so the rule carries over unchanged."""
        return tuple(range(self.speech_token_size, self.speech_token_size + self.num_special_tokens))


@dataclass(frozen=True)
class DiTConfig:
    """The flow's DiT estimator (adaLN-Zero blocks, rotary attention, causal conv position embedding)."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: float = 2.0
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # frames of one attention chunk in streaming calls
    num_decoding_left_chunks: int = -1  # -1: a frame sees every earlier chunk
    frequency_embedding_size: int = 256
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def in_channels(self) -> int:
        """x, cond, mu and the speaker embedding, concatenated per frame."""
        return 2 * self.mel_dim + self.mu_dim + self.spk_dim

    @property
    def ff_inner(self) -> int:
        return int(self.dim * self.ff_mult)


@dataclass(frozen=True)
class FlowConfig:
    """CausalMaskedDiffWithDiT: token embedding, lookahead conv, x2 repeat, CFM over the DiT."""

    vocab_size: int = 6561
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 15000  # the fixed noise table: 300 s of mel frames
    noise_seed: int = 0
    dit: DiTConfig = field(default_factory=DiTConfig)

    def __post_init__(self) -> None:
        if self.input_size != self.dit.mu_dim or self.output_size != self.dit.mel_dim:
            raise CosyVoice3ConfigError("the token embedding width must equal the DiT mu_dim and the mel bins its mel_dim")
        if self.dit.out_channels != self.output_size:
            raise CosyVoice3ConfigError("the DiT out_channels must equal the mel bins")


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    """CausalHiFTGenerator: CosyVoice2's HiFT sizes plus the causal parts' look-ahead and the fixed noise tables."""

    conv_pre_look_right: int = 4
    f0_lookahead: int = 3  # right context of the f0 predictor's first conv (kernel f0_lookahead + 1)
    #: seed of the construction-time noise tables (phases (1, H), then uniform noise (1, T, H)); see docs
    noise_seed: int = 0
    noise_seconds: int = 300

    @property
    def held_back_frames(self) -> int:
        """Mel frames a non-final call cannot vocode yet: f0 context, conv_pre look-ahead, one iSTFT frame."""
        return self.f0_lookahead + self.conv_pre_look_right + 1


@dataclass(frozen=True)
class CosyVoice3Config:
    llm: CosyVoice3LLMConfig = field(default_factory=CosyVoice3LLMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: CausalHiFTConfig = field(default_factory=CausalHiFTConfig)
    sample_rate: int = 24000

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **overrides: Any) -> "CosyVoice3Config":
        """From `cosyvoice3.yaml` and `CosyVoice-BlankEN/config.json` of a model directory."""
        model_dir = Path(model_dir)
        for name in (MODEL_YAML, QWEN_CONFIG):
            if not (model_dir / name).is_file():
                raise CosyVoice3ConfigError(f"{model_dir} lacks {name}")
        qwen = json.loads((model_dir / QWEN_CONFIG).read_text())
        return cls.from_yaml(read_release_yaml((model_dir / MODEL_YAML).read_text()), qwen, **overrides)

    @classmethod
    def from_yaml(cls, data: Mapping[str, Any], qwen: Mapping[str, Any], **overrides: Any) -> "CosyVoice3Config":
        """From a parsed `cosyvoice3.yaml` (`read_release_yaml`) and the Qwen2 config mapping.
        `overrides`: fields of the LLM config to replace (e.g. `endofprompt_id` for a small text vocabulary)."""
        for key in ("llm", "flow", "hift"):
            if key not in data:
                raise CosyVoice3ConfigError(f"{MODEL_YAML} has no top-level {key!r} entry")
        return cls(llm=_llm_config(data["llm"], qwen, overrides), flow=_flow_config(data["flow"]),
                   hift=_hift_config(data["hift"]), sample_rate=int(data.get("sample_rate", 24000)))


def _check_class(section: Mapping[str, Any], name: str, where: str) -> None:
    if not isinstance(section, Mapping):
        raise CosyVoice3ConfigError(f"{where} must be a !new: mapping of constructor arguments")
    tag = section.get("__class__")
    if tag is not None and tag.rsplit(".", 1)[-1] != name:
        raise CosyVoice3ConfigError(f"{where} is {tag}, expected a {name}")


def _llm_config(llm: Mapping[str, Any], qwen: Mapping[str, Any], overrides: Mapping[str, Any]) -> CosyVoice3LLMConfig:
    _check_class(llm, LLM_CLASS, "llm")
    if int(llm["llm_input_size"]) != int(qwen["hidden_size"]) or int(llm["llm_output_size"]) != int(qwen["hidden_size"]):
        raise CosyVoice3ConfigError(f"llm_input_size/llm_output_size must equal the Qwen2 hidden size {qwen['hidden_size']}")
    sampling = llm.get("sampling", {})
    ras = RASConfig(**{k: type(getattr(RASConfig(), k))(sampling[k]) for k in ("top_p", "top_k", "win_size", "tau_r")
                       if k in sampling})
    return CosyVoice3LLMConfig(qwen=Qwen2Config.from_dict(qwen), speech_token_size=int(llm["speech_token_size"]),
                               sampling=ras, **overrides)


def _flow_config(flow: Mapping[str, Any]) -> FlowConfig:
    _check_class(flow, FLOW_CLASS, "flow")
    if flow.get("output_type", "mel") != "mel":
        raise CosyVoice3ConfigError(f"flow.output_type must be 'mel', got {flow['output_type']!r}")
    lookahead, cfm = flow["pre_lookahead_layer"], flow["decoder"]
    _check_class(lookahead, LOOKAHEAD_CLASS, "flow.pre_lookahead_layer")
    _check_class(cfm, CFM_CLASS, "flow.decoder")
    est = cfm.get("estimator", flow.get("estimator"))  # the parity harness lists the estimator beside the decoder
    _check_class(est, DIT_CLASS, "flow.decoder.estimator")
    params = cfm.get("cfm_params", {})
    params = params.get("content", params)  # `!new:omegaconf.DictConfig {content: ...}` in the release
    if params.get("solver", "euler") != "euler" or params.get("t_scheduler", "cosine") != "cosine":
        raise CosyVoice3ConfigError("only the Euler solver on the cosine time grid is implemented")
    if int(lookahead["pre_lookahead_len"]) != int(flow["pre_lookahead_len"]):
        raise CosyVoice3ConfigError("flow.pre_lookahead_len differs from its lookahead layer's")
    if int(lookahead["in_channels"]) != int(flow["input_size"]):
        raise CosyVoice3ConfigError("the lookahead layer's in_channels must equal flow.input_size")
    dit = DiTConfig(dim=int(est["dim"]), depth=int(est["depth"]), heads=int(est["heads"]),
                    dim_head=int(est["dim_head"]), ff_mult=float(est.get("ff_mult", 4)),
                    mel_dim=int(est.get("mel_dim", 80)), mu_dim=int(est.get("mu_dim", est.get("mel_dim", 80))),
                    spk_dim=int(est["spk_dim"]), out_channels=int(est.get("out_channels", 80)),
                    static_chunk_size=int(est.get("static_chunk_size", 50)),
                    num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)))
    if dit.num_decoding_left_chunks != -1:
        raise CosyVoice3ConfigError("only num_decoding_left_chunks -1 (every earlier chunk visible) is implemented")
    if int(cfm.get("spk_emb_dim", dit.spk_dim)) != dit.spk_dim:
        raise CosyVoice3ConfigError("flow.decoder.spk_emb_dim must equal the DiT spk_dim")
    return FlowConfig(vocab_size=int(flow["vocab_size"]), input_size=int(flow["input_size"]),
                      output_size=int(flow["output_size"]), spk_embed_dim=int(flow["spk_embed_dim"]),
                      token_mel_ratio=int(flow["token_mel_ratio"]), pre_lookahead_len=int(flow["pre_lookahead_len"]),
                      pre_lookahead_channels=int(lookahead["channels"]),
                      inference_cfg_rate=float(params.get("inference_cfg_rate", 0.7)), dit=dit)


def _hift_config(hift: Mapping[str, Any]) -> CausalHiFTConfig:
    _check_class(hift, HIFT_CLASS, "hift")
    _check_class(hift.get("f0_predictor", {}), F0_CLASS, "hift.f0_predictor")
    plain = {k: v for k, v in hift.items() if k != "__class__"}
    plain["f0_predictor"] = {k: v for k, v in plain.get("f0_predictor", {}).items() if k != "__class__"}
    return CausalHiFTConfig.from_dict(plain)


# ---- HyperPyYAML as data -------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    expression: str


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


def _arithmetic(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arithmetic(node.operand)
    raise CosyVoice3ConfigError(f"unsupported !ref expression element {ast.dump(node)}")


def _resolve(value: Any, top: Mapping[str, Any], depth: int = 0) -> Any:
    if depth > 32:
        raise CosyVoice3ConfigError("!ref references form a cycle")
    if isinstance(value, _Ref):
        names = re.findall(r"<([^<>]+)>", value.expression)
        for name in names:
            if name.split(".")[0] not in top:
                raise CosyVoice3ConfigError(f"!ref {value.expression!r} names an unknown key {name!r}")
        if re.fullmatch(r"\s*<[^<>]+>\s*", value.expression):  # a plain reference keeps its type
            return _resolve(_lookup(top, names[0]), top, depth + 1)
        values = {name: _resolve(_lookup(top, name), top, depth + 1) for name in names}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()):
            text = re.sub(r"<([^<>]+)>", lambda m: repr(values[m.group(1)]), value.expression)
            try:
                return _arithmetic(ast.parse(text, mode="eval"))
            except SyntaxError:
                pass
        # otherwise string interpolation, e.g. `!ref <model_dir>/file.txt`
        return re.sub(r"<([^<>]+)>", lambda m: str(values[m.group(1)]), value.expression)
    if isinstance(value, dict):
        return {k: _resolve(v, top, depth) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, depth) for v in value]
    return value


def _lookup(top: Mapping[str, Any], dotted: str) -> Any:
    value: Any = top
    for part in dotted.split("."):
        value = value[part]
    return value


def read_release_yaml(text: str) -> dict[str, Any]:
    """Parse a HyperPyYAML text as plain data (see the module docstring)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            return {"__class__": suffix, **loader.construct_mapping(node, deep=True)}
        if isinstance(node, yaml.SequenceNode):
            return {"__class__": suffix, "args": loader.construct_sequence(node, deep=True)}
        return {"__class__": suffix, "value": loader.construct_scalar(node)}

    def ref(loader: yaml.SafeLoader, node: yaml.Node) -> _Ref:
        return _Ref(str(loader.construct_scalar(node)))

    Loader.add_constructor("!ref", ref)
    for prefix in ("!new:", "!name:", "!apply:", "!"):  # the catch-all "!" last: other tags become data too
        Loader.add_multi_constructor(prefix, tagged)
    try:
        data = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass with data-only constructors
    except yaml.YAMLError as exc:
        raise CosyVoice3ConfigError(f"{MODEL_YAML} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CosyVoice3ConfigError(f"{MODEL_YAML} must hold a mapping")
    return _resolve(data, data)
