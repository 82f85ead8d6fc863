"""The flat LLM vocabulary of the converted (Hugging Face / TensorRT-LLM) CosyVoice2 checkpoint.

One definition for the build tooling that writes the checkpoint and the serving code that feeds it
(import-light: numpy only, no torch)::

    [0, T)                 text tokens (T = len(CosyVoice2 tokenizer) = 151663 for the released model)
    T + k, k < 6561        speech token k                      <|s_k|>
    T + 6561 .. T + 6563   the three end ids (EOS, 6562, FILL)  <|eos1|> <|eos2|> <|eos3|>
    T + 6564, T + 6565     <|sos|>, <|task_id|>
    up to a multiple of 128  padding
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

LAYOUT_FILE = "cosyvoice2_llm.json"
LOGITS_BIAS_FILE = "logits_bias.safetensors"
LOGITS_BIAS_KEY = "logits_bias"  # the one tensor in LOGITS_BIAS_FILE
VOCAB_PAD_MULTIPLE = 128
END_TOKENS = ("<|eos1|>", "<|eos2|>", "<|eos3|>")


@dataclass(frozen=True)
class SpeechVocabLayout:
    """Where speech tokens, end ids and prompt markers sit in the extended vocabulary."""

    text_vocab_size: int  # = offset of speech token 0 (ORIGINAL_VOCAB_SIZE upstream)
    speech_token_size: int = 6561

    @property
    def speech_offset(self) -> int:
        return self.text_vocab_size

    @property
    def num_speech_classes(self) -> int:
        """Rows of ``llm_decoder``/``speech_embedding``: speech tokens plus the three end ids."""
        return self.speech_token_size + len(END_TOKENS)

    @property
    def end_ids(self) -> tuple[int, ...]:
        """All three stop the decode (the reference's stop_token_ids); the first is EOS proper."""
        first = self.speech_offset + self.speech_token_size
        return tuple(range(first, first + len(END_TOKENS)))

    @property
    def end_id(self) -> int:
        """The end id of a TensorRT-LLM request: the one its minimum length masks."""
        return self.end_ids[0]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The other ids that end a request (TensorRT-LLM stop words; not masked below the minimum length)."""
        return self.end_ids[1:]

    @property
    def sos_id(self) -> int:
        return self.speech_offset + self.num_speech_classes

    @property
    def task_id_id(self) -> int:
        return self.sos_id + 1

    @property
    def vocab_size(self) -> int:
        return self.task_id_id + 1

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def to_vocab_id(self, speech_token: int) -> int:
        return self.speech_offset + speech_token

    def to_vocab_ids(self, speech_tokens: np.ndarray) -> np.ndarray:
        return speech_tokens.astype(np.int32) + self.speech_offset

    def to_speech_tokens(self, vocab_ids: np.ndarray) -> np.ndarray:
        """Inverse of ``to_vocab_ids`` without a range check: ids outside the speech range come out < 0 or
        >= ``speech_token_size`` (the caller decides what they mean: an end id, a stray text id)."""
        return np.asarray(vocab_ids) - self.speech_offset

    def to_speech_token(self, vocab_id: int) -> int:
        """Inverse of ``to_vocab_id``; refuses ids outside the speech range (end ids included: they stop)."""
        token = vocab_id - self.speech_offset
        if not 0 <= token < self.speech_token_size:
            raise ValueError(f"vocabulary id {vocab_id} is not a speech token")
        return token

    def to_json(self) -> dict[str, object]:
        return {
            **asdict(self),
            "speech_offset": self.speech_offset,
            "end_ids": list(self.end_ids),
            "sos_id": self.sos_id,
            "task_id_id": self.task_id_id,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.padded_vocab_size,
            "logits_bias_file": LOGITS_BIAS_FILE,
        }

    @classmethod
    def load(cls, hf_dir: Path) -> SpeechVocabLayout:
        data = json.loads((Path(hf_dir) / LAYOUT_FILE).read_text())
        fields = {name: int(data[name]) for name in cls.__dataclass_fields__ if name in data}
        return cls(**fields)
