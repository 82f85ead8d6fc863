"""Hyper-parameters of the Qwen2 body every speech LM on the runtime shares.

Torch-free on purpose: configuration is read by processes that never run a model (the orchestrator reads a model's
vocabulary from its config), so nothing here may import torch; the modules holding the model import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class Qwen2Config:
    """Qwen2 body hyper-parameters; defaults are the 0.5B body of CosyVoice2-0.5B (``CosyVoice-BlankEN/config.json``)."""

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
            raise ValueError("sliding-window attention is not supported (no supported model uses it)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass(frozen=True)
class OutputVocabulary:
    """What the batched decoder knows of a model's output ids (its ``SpeechLM.vocabulary``).

    ``size``: width of a log-prob row. ``stop_ids``: ascending and contiguous (one slice of the row); drawing any
    of them ends the request, and none is ever emitted. ``masked_below_min``: the one stop id that cannot be drawn
    while a request has fewer than its ``min_tokens`` tokens (the others can; every model so far masks exactly one).
    """

    size: int
    stop_ids: tuple[int, ...]
    masked_below_min: int

    def __post_init__(self) -> None:
        ids = self.stop_ids
        if not ids or list(ids) != list(range(ids[0], ids[0] + len(ids))) or ids[0] < 0 or ids[-1] >= self.size:
            raise ValueError(f"stop ids must be a non-empty ascending run of ids below {self.size}, got {ids}")
        if self.masked_below_min not in ids:
            raise ValueError(f"the id masked below the minimum length ({self.masked_below_min}) must be a stop id")
