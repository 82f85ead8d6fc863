"""Flow matching decoder of CosyVoice2: speech tokens -> 80-bin mel at 50 Hz.

The configs import eagerly (torch-free); the model resolves lazily (`cosyvoice2.lazy`) so that
`cosyvoice2.flow.config` imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cosyvoice2.flow.config import CFMConfig, EncoderConfig, EstimatorConfig, FlowConfig
from cosyvoice2.lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from cosyvoice2.flow.model import CausalFlow

__all__ = ["CFMConfig", "CausalFlow", "EncoderConfig", "EstimatorConfig", "FlowConfig"]
__getattr__, __dir__ = lazy_exports(globals(), {"CausalFlow": "cosyvoice2.flow.model"})
