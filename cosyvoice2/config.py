"""EngineConfig: the hyper-parameters of every part, released CosyVoice2-0.5B values by default.

Where the numbers come from, for a model directory (`EngineConfig.for_model_dir`):
1. the released defaults of each part's config dataclass;
2. the Qwen2 body fields of ``CosyVoice-BlankEN/config.json`` (upstream reads the body size from there too);
3. ``engine_config.json`` in the model directory, if present (tiny test models write one). Each section present
   replaces that part's config; absent sections keep 1./2. Sections and their formats:
   ``llm``: ``{"qwen": <HF Qwen2 config fields>, "speech_token_size": int}``; ``flow``: ``FlowConfig`` as
   ``dataclasses.asdict``; ``hift``: upstream HiFTGenerator arguments (``HiFTConfig.to_dict``);
   ``streaming``: ``StreamingConfig`` fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from cosyvoice2.flow.config import FlowConfig
from cosyvoice2.hift.config import HiFTConfig
from cosyvoice2.layout import TOKENIZER_SUBDIR
from cosyvoice2.llm.config import LLMConfig
from cosyvoice2.streaming import ChunkSchedule
from speech_lm.config import Qwen2Config

if TYPE_CHECKING:
    import torch

ENGINE_CONFIG_FILE = "engine_config.json"
QWEN_CONFIG_FILE = f"{TOKENIZER_SUBDIR}/config.json"

_DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class StreamingConfig:
    """Upstream CosyVoice2Model streaming constants (docs/reference/cosyvoice2.md#streaming-schedule)."""

    token_hop_len: int = 25  # first hop; equals the flow's training chunk of 25 tokens
    token_max_hop_len: int = 100
    stream_scale_factor: int = 2
    mel_cache_len: int = 8  # mel frames HiFT re-vocodes at the start of each chunk

    def schedule(self, prompt_tokens: int, lookahead: int, first_hop: int | None = None) -> ChunkSchedule:
        return ChunkSchedule(prompt_tokens=prompt_tokens, first_hop=first_hop or self.token_hop_len,
                             grid=self.token_hop_len, max_hop=self.token_max_hop_len,
                             growth=self.stream_scale_factor, lookahead=lookahead)


@dataclass(frozen=True)
class EngineConfig:
    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)

    @property
    def sample_rate(self) -> int:
        return self.hift.sampling_rate

    @property
    def samples_per_token(self) -> int:
        """Audio samples per speech token: token_mel_ratio x HiFT samples per mel frame (2 x 480 = 960)."""
        return self.flow.token_mel_ratio * self.hift.samples_per_frame

    def schedule(self, prompt_tokens: int, first_hop: int | None = None) -> ChunkSchedule:
        return self.streaming.schedule(prompt_tokens, self.flow.pre_lookahead_len, first_hop)

    # ---- (de)serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "llm": {"qwen": asdict(self.llm.qwen), "speech_token_size": self.llm.speech_token_size},
            "flow": asdict(self.flow),
            "hift": self.hift.to_dict(),
            "streaming": asdict(self.streaming),
        }

    def updated(self, sections: Mapping[str, Any]) -> "EngineConfig":
        """A copy with the given sections (format as in `to_dict`) replacing this config's parts."""
        unknown = set(sections) - {"llm", "flow", "hift", "streaming"}
        if unknown:
            raise ValueError(f"unknown engine config sections {sorted(unknown)}")
        parts: dict[str, Any] = {}
        if "llm" in sections:
            parts["llm"] = LLMConfig.from_harness(sections["llm"])
        if "flow" in sections:
            parts["flow"] = FlowConfig.from_dict(sections["flow"])
        if "hift" in sections:
            parts["hift"] = HiFTConfig.from_dict(sections["hift"])
        if "streaming" in sections:
            parts["streaming"] = StreamingConfig(**sections["streaming"])
        return replace(self, **parts)

    @classmethod
    def from_dict(cls, sections: Mapping[str, Any]) -> "EngineConfig":
        return cls().updated(sections)

    @classmethod
    def from_harness(cls, harness: Mapping[str, Any]) -> "EngineConfig":
        """From the parity harness's ``harness_config.json`` (upstream constructor arguments per part)."""
        return cls(llm=LLMConfig.from_harness(harness["llm"]), flow=FlowConfig.from_harness(harness["flow"]),
                   hift=HiFTConfig.from_dict(harness["hift"]))

    @classmethod
    def for_model_dir(cls, model_dir: str | Path) -> "EngineConfig":
        """Released defaults, then BlankEN's Qwen2 fields, then ``engine_config.json`` (see module doc)."""
        model_dir = Path(model_dir)
        config = cls()
        qwen_file = model_dir / QWEN_CONFIG_FILE
        if qwen_file.is_file():
            qwen = Qwen2Config.from_dict(_read_json(qwen_file))
            config = replace(config, llm=replace(config.llm, qwen=qwen))
        override = model_dir / ENGINE_CONFIG_FILE
        if override.is_file():
            config = config.updated(_read_json(override))
        return config

    def write(self, model_dir: str | Path) -> Path:
        path = Path(model_dir) / ENGINE_CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc


def resolve_dtype(dtype: "str | torch.dtype") -> "torch.dtype":
    """'fp32' / 'fp16' / 'bf16' (or their long names, or a torch.dtype) -> torch.dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = _DTYPE_NAMES.get(str(dtype).lower())
        if name is None:
            raise ValueError(f"unsupported dtype {dtype!r}; use fp32, fp16 or bf16")
        resolved = getattr(torch, name)
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {resolved}; use fp32, fp16 or bf16")
    return resolved
