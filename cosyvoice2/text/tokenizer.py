"""The CosyVoice2 text tokenizer: Qwen2 byte-level BPE from ``<model_dir>/CosyVoice-BlankEN`` plus 17 specials.

Upstream registers ``<|endoftext|>`` as eos/pad and then the 19 additional specials below, in this order. The first
two already exist in the base tokenizer, so the 17 new ones get consecutive ids right after it
(released model: ``<|endofprompt|>`` = 151646 ... ``[mn]`` = 151662, ``len(tokenizer)`` = 151663).
Encoding adds no BOS/EOS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self, Sequence

TOKENIZER_SUBDIR = "CosyVoice-BlankEN"

ADDITIONAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]",
    "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)
ENDOFTEXT = "<|endoftext|>"
ENDOFPROMPT = "<|endofprompt|>"


class CosyVoice2Tokenizer:
    """Text -> Qwen2 token ids, as CosyVoice2's frontend computes them.

    A subclass with another model's special tokens overrides `special_tokens` (registered in that order after
    ``<|endoftext|>``; tokens the base vocabulary already has keep their ids)."""

    special_tokens: tuple[str, ...] = ADDITIONAL_SPECIAL_TOKENS

    def __init__(self, tokenizer_dir: str | Path) -> None:
        # Imported here, not at module level: the orchestrator imports this module for its special-token names,
        # and transformers would pull torch into a process that never runs a model.
        from transformers import AutoTokenizer  # noqa: PLC0415

        self._hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self._hf.add_special_tokens(
            {
                "eos_token": ENDOFTEXT,
                "pad_token": ENDOFTEXT,
                "additional_special_tokens": list(self.special_tokens),
            }
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Self":
        return cls(Path(model_dir) / TOKENIZER_SUBDIR)

    def __len__(self) -> int:
        return len(self._hf)

    def encode(self, text: str) -> list[int]:
        return list(self._hf([text])["input_ids"][0])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        token_id = self._hf.convert_tokens_to_ids(token)
        if token_id is None or token_id == self._hf.unk_token_id:
            raise KeyError(f"unknown token {token!r}")
        return int(token_id)

    def count(self, text: str) -> int:
        """Number of tokens of ``text``: the length function the English paragraph splitter uses."""
        return len(self.encode(text))
