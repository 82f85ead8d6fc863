"""CosyVoice2 inference engine (our own PyTorch implementation).

Import-light on purpose: the torch-free gateway imports ``cosyvoice2.text.segment``, so nothing here may
import torch at package import time. The public entry points are resolved lazily on first access::

    import cosyvoice2
    tts = cosyvoice2.load("/models/CosyVoice2-0.5B", device="cuda")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cosyvoice2' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
