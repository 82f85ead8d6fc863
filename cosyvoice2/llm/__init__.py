"""CosyVoice2 LLM: Qwen2 body, speech head, sampling and decoding.

The names resolve lazily (`cosyvoice2.lazy`) so that `cosyvoice2.llm.config` imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice2.llm.config import LLMConfig, Qwen2Config
    from cosyvoice2.llm.decode import (
        BatchedDecoder,
        DecodeRequest,
        NoFreeSlotError,
        SlotOutput,
        generate_tokens,
        required_seq_len,
        token_limits,
    )
    from cosyvoice2.llm.model import CosyVoice2LM
    from cosyvoice2.llm.qwen2 import StaticKVCache
    from cosyvoice2.llm.sampling import SamplingParams

_LAZY: dict[str, str] = {
    "BatchedDecoder": "cosyvoice2.llm.decode",
    "DecodeRequest": "cosyvoice2.llm.decode",
    "NoFreeSlotError": "cosyvoice2.llm.decode",
    "SlotOutput": "cosyvoice2.llm.decode",
    "generate_tokens": "cosyvoice2.llm.decode",
    "required_seq_len": "cosyvoice2.llm.decode",
    "token_limits": "cosyvoice2.llm.decode",
    "CosyVoice2LM": "cosyvoice2.llm.model",
    "LLMConfig": "cosyvoice2.llm.config",
    "Qwen2Config": "cosyvoice2.llm.config",
    "StaticKVCache": "cosyvoice2.llm.qwen2",
    "SamplingParams": "cosyvoice2.llm.sampling",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
