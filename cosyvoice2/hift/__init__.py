"""HiFT vocoder (HiFTGenerator) of CosyVoice2."""

from .config import HiFTConfig
from .generator import HiFTGenerator
from .source import SourceNoise

__all__ = ["HiFTConfig", "HiFTGenerator", "SourceNoise"]
