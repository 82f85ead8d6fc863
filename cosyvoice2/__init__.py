"""CosyVoice2 inference engine (our own PyTorch implementation).

Import-light on purpose: torch-free processes (the orchestrator, the render tool) import its configuration
and prompt modules, so nothing here may import torch at package import time. The public entry points are
resolved lazily on first access::

    import cosyvoice2
    tts = cosyvoice2.load("/models/CosyVoice2-0.5B", device="cuda")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice2.frontend.prompt import VoicePrompt
    from cosyvoice2.loading import load
    from cosyvoice2.pipeline import CosyVoice2

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "load": "cosyvoice2.loading",
    "CosyVoice2": "cosyvoice2.pipeline",
    "VoicePrompt": "cosyvoice2.frontend.prompt",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
