"""CosyVoice2 LLM: the speech embedding and head around the shared Qwen2 body, CosyVoice2's prefix layout and
decoding rules (`request`) and defaults (`sampling_defaults`).

The Qwen2 body, the batched decoder and sampling are the model-neutral runtime in `speech_lm`. The names resolve
lazily (`cosyvoice2.lazy`) so that `cosyvoice2.llm.config` imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice2.llm.config import LLMConfig
    from cosyvoice2.llm.model import CosyVoice2LM
    from cosyvoice2.llm.request import CosyVoice2Prefix, CosyVoice2Sampling, cosyvoice2_request, decode_request

_LAZY: dict[str, str] = {
    "CosyVoice2LM": "cosyvoice2.llm.model",
    "LLMConfig": "cosyvoice2.llm.config",
    "CosyVoice2Prefix": "cosyvoice2.llm.request",
    "CosyVoice2Sampling": "cosyvoice2.llm.request",
    "cosyvoice2_request": "cosyvoice2.llm.request",
    "decode_request": "cosyvoice2.llm.request",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
