"""Flow matching decoder of CosyVoice2: speech tokens -> 80-bin mel at 50 Hz."""

from .config import CFMConfig, EncoderConfig, EstimatorConfig, FlowConfig
from .model import CausalFlow

__all__ = ["CFMConfig", "CausalFlow", "EncoderConfig", "EstimatorConfig", "FlowConfig"]
