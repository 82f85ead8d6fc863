"""The silent-token filter of CosyVoice3's synthesis loop (torch-free: the PyTorch LLM's handler applies it to
the decoded tokens, the orchestrators to what a TensorRT-LLM engine returns)."""

from __future__ import annotations

from typing import Iterable, Iterator

from .config import CosyVoice3LLMConfig


class SilentTokenFilter:
    """Drops silent/breath tokens beyond `max_run` in a row (the run counter resets on any other token)."""

    def __init__(self, silent_tokens: Iterable[int], max_run: int) -> None:
        self.silent = frozenset(int(t) for t in silent_tokens)
        self.max_run = max_run
        self._run = 0

    def accept(self, token: int) -> bool:
        if token in self.silent:
            self._run += 1
            return self._run <= self.max_run
        self._run = 0
        return True

    def filter(self, tokens: Iterable[int]) -> Iterator[int]:
        return (t for t in tokens if self.accept(t))

    @classmethod
    def for_config(cls, config: CosyVoice3LLMConfig) -> "SilentTokenFilter":
        return cls(config.silent_tokens, config.max_silent_run)
