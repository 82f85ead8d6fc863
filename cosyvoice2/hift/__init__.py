"""HiFT vocoder (HiFTGenerator) of CosyVoice2.

The config imports eagerly (torch-free); the modules resolve lazily (`cosyvoice2.lazy`) so that
`cosyvoice2.hift.config` imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.hift.config import HiFTConfig
from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice2.hift.generator import HiFTGenerator
    from cosyvoice2.hift.source import SourceNoise

__all__ = ["HiFTConfig", "HiFTGenerator", "SourceNoise"]
__getattr__, __dir__ = lazy_exports(globals(), {"HiFTGenerator": "cosyvoice2.hift.generator",
                                                "SourceNoise": "cosyvoice2.hift.source"})
