"""CosyVoice2 LLM: the speech embedding and head around the shared Qwen2 body, and CosyVoice2's decoding defaults.

The Qwen2 body, the batched decoder and sampling are the model-neutral runtime in `speech_lm`. The names resolve
lazily (`cosyvoice2.lazy`) so that `cosyvoice2.llm.config` imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice2.llm.config import LLMConfig
    from cosyvoice2.llm.model import CosyVoice2LM

_LAZY: dict[str, str] = {
    "CosyVoice2LM": "cosyvoice2.llm.model",
    "LLMConfig": "cosyvoice2.llm.config",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
