"""CosyVoice2 LLM hyper-parameters: the Qwen2 body (`speech_lm.config.Qwen2Config`) and the speech-token vocabulary.

Torch-free on purpose: configuration is read by processes that never run the model (the orchestrator reads the
speech vocabulary from it), so nothing here may import torch; the modules holding the model import it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from speech_lm.config import OutputVocabulary, Qwen2Config


@dataclass(frozen=True)
class LLMConfig:
    """CosyVoice2 LLM hyper-parameters; defaults are the released CosyVoice2-0.5B values."""

    qwen: Qwen2Config = field(default_factory=Qwen2Config)
    speech_token_size: int = 6561

    @property
    def hidden_size(self) -> int:
        return self.qwen.hidden_size

    @property
    def num_speech_classes(self) -> int:
        """Speech ids 0..6560 plus the end ids 6561 (EOS), 6562, 6563 (FILL)."""
        return self.speech_token_size + 3

    @property
    def eos_id(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.speech_token_size + 3))

    @property
    def vocabulary(self) -> OutputVocabulary:
        """The decoder's view of the head: below the minimum length the id ``speech_token_size`` is masked, as
        upstream does (EOS here; subclasses with another id layout inherit the same index)."""
        return OutputVocabulary(self.num_speech_classes, self.stop_ids, masked_below_min=self.speech_token_size)

    @classmethod
    def from_harness(cls, values: Mapping[str, Any]) -> "LLMConfig":
        """From a dict such as the parity harness's ``llm`` section (``qwen`` = HF Qwen2 config fields).
        Missing entries keep the released defaults."""
        defaults = cls()
        qwen = Qwen2Config.from_dict(values["qwen"]) if "qwen" in values else defaults.qwen
        return cls(qwen=qwen, speech_token_size=int(values.get("speech_token_size", defaults.speech_token_size)))
