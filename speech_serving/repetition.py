"""A loop guard for LLM backends that cannot run repetition-aware sampling (RAS).

Our PyTorch LLM samples with RAS (speech_lm.sampling): a nucleus pick that already occurs among the last
10 emitted tokens is redrawn from the full distribution, so the decoder cannot settle into repeating itself.
TensorRT-LLM's C++ backend has no hook for that (no logits post-processor in the Triton backend); its nearest
control is `repetition_penalty`, which makes repeats less likely but cannot forbid them. A sampled loop then runs
until the request's token limit: up to 20 x the text length of stuck audio.

The guard watches the speech tokens as they arrive and says where to end the utterance once the tail has turned
into a loop: the same token `max_run` times in a row, or a short cycle (period 2..`max_period`) repeating over
`max_cycle_tokens` tokens. Both limits are far above what natural speech produces (25 tokens = 1 s of one
token; RAS output never repeats a token back to back) and bound the damage when a loop starts. Plain python,
O(max_period) per token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopGuardConfig:
    max_run: int = 25  # identical tokens in a row (25 Hz: 1 s of one token)
    max_period: int = 4  # longest cycle looked for
    max_cycle_tokens: int = 50  # tokens covered by a repeating cycle of period 2..max_period (2 s)

    def __post_init__(self) -> None:
        if self.max_run < 2 or self.max_period < 1 or self.max_cycle_tokens < 2 * max(self.max_period, 2):
            raise ValueError(
                f"loop guard limits must satisfy max_run >= 2, max_period >= 1, max_cycle_tokens >= 2 x max_period; got {self}"
            )

    def start(self) -> LoopGuard:
        return LoopGuard(self)


class LoopGuard:
    """Per-request state: the last `max_period` tokens and, per period p, how many consecutive tokens equalled
    the token p positions earlier."""

    def __init__(self, config: LoopGuardConfig) -> None:
        self.config = config
        self.recent: list[int] = []
        self.streak = [0] * (config.max_period + 1)  # streak[p]; index 0 unused
        self.tripped = False

    def feed(self, tokens: list[int]) -> int | None:
        """Take the next tokens; return the index in `tokens` where the utterance should end (the token that
        completes a loop and everything after it are dropped), or None while no loop is found."""
        config = self.config
        for index, token in enumerate(tokens):
            for p in range(1, config.max_period + 1):
                same = len(self.recent) >= p and self.recent[-p] == token
                self.streak[p] = self.streak[p] + 1 if same else 0
                # a streak of s at period p means the last s + p tokens repeat with that period
                limit = config.max_run if p == 1 else config.max_cycle_tokens
                if same and self.streak[p] + p >= limit:
                    self.tripped = True
                    return index
            self.recent.append(token)
            del self.recent[: -config.max_period]
        return None
