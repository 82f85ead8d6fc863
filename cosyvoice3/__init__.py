"""CosyVoice3 (Fun-CosyVoice3-0.5B-2512) inference engine: LLM, DiT flow and causal HiFT, offline and streaming.

Import-light like `cosyvoice2`: `cosyvoice3.config` and `cosyvoice3.layout` are torch-free, and the entry points
resolve lazily on first access::

    import cosyvoice3
    engine = cosyvoice3.load("/models/Fun-CosyVoice3-0.5B-2512", device="cuda")

See docs/cosyvoice3.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice3.config import CosyVoice3Config
    from cosyvoice3.engine import CosyVoice3, SynthesisRequest
    from cosyvoice3.frontend import PromptFrontend
    from cosyvoice3.loading import load
    from cosyvoice3.text import CosyVoice3Tokenizer
    from cosyvoice3.token2wav import CosyVoice3Token2Wav, VoicePrompt

_LAZY: dict[str, str] = {
    "load": "cosyvoice3.loading",
    "CosyVoice3": "cosyvoice3.engine",
    "SynthesisRequest": "cosyvoice3.engine",
    "CosyVoice3Config": "cosyvoice3.config",
    "CosyVoice3Token2Wav": "cosyvoice3.token2wav",
    "VoicePrompt": "cosyvoice3.token2wav",
    "CosyVoice3Tokenizer": "cosyvoice3.text",
    "PromptFrontend": "cosyvoice3.frontend",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
