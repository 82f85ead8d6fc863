"""The LLM's hyper-parameters: the Qwen2 body and the speech-token vocabulary.

Torch-free on purpose: configuration is read by processes that never run the model (the orchestrator reads the
speech vocabulary from it), so nothing here may import torch; the modules holding the model import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class Qwen2Config:
    """Qwen2 body hyper-parameters; defaults are CosyVoice2-0.5B's (``CosyVoice-BlankEN/config.json``)."""

    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Qwen2Config":
        """Build from an HF-style config dict (unknown fields such as ``attn_implementation`` are ignored)."""
        if values.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported (CosyVoice2 does not use it)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass(frozen=True)
class LLMConfig:
    """CosyVoice2 LLM hyper-parameters; defaults are the released CosyVoice2-0.5B values."""

    qwen: Qwen2Config = field(default_factory=Qwen2Config)
    speech_token_size: int = 6561

    @property
    def hidden_size(self) -> int:
        return self.qwen.hidden_size

    @property
    def num_speech_classes(self) -> int:
        """Speech ids 0..6560 plus the end ids 6561 (EOS), 6562, 6563 (FILL)."""
        return self.speech_token_size + 3

    @property
    def eos_id(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.speech_token_size + 3))

    @classmethod
    def from_harness(cls, values: Mapping[str, Any]) -> "LLMConfig":
        """From a dict such as the parity harness's ``llm`` section (``qwen`` = HF Qwen2 config fields).
        Missing entries keep the released defaults."""
        defaults = cls()
        qwen = Qwen2Config.from_dict(values["qwen"]) if "qwen" in values else defaults.qwen
        return cls(qwen=qwen, speech_token_size=int(values.get("speech_token_size", defaults.speech_token_size)))
