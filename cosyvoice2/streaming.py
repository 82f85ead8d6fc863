"""Streaming token2wav: the chunk schedule and the per-stream state (spec §5).

Three layers, each with one job:

* `ChunkSchedule` is pure arithmetic: which token range each flow call covers. No torch, unit-testable.
* `Token2Wav` is stateless: tokens -> mel (flow) and mel -> audio (HiFT) for one prompt.
* `Token2WavStream` owns *all* mutable state of one stream (token buffer, schedule position, HiFT
  mel/source/speech caches, noise generator). Upstream keeps the hop length on the shared model object,
  so a second request starts with the grown hop; here nothing mutable is shared, so a server can keep one
  stream per request id and interleave them freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:  # torch stays out of the pure schedule's import path
    import torch


@dataclass(frozen=True)
class Chunk:
    """One flow + HiFT call of a stream, in generated-token indices (prompt tokens not counted)."""

    start: int  # first token whose audio this chunk emits (upstream's token_offset)
    stop: int  # one past the last token whose audio this chunk emits
    feed: int  # the flow sees tokens[:feed]; feed - stop tokens are lookahead context only
    final: bool  # final chunk: full attention, lookahead padded, every remaining sample emitted

    @property
    def hop(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ChunkSchedule:
    """Upstream's chunk schedule: hop 25 + prompt pad, then x2 growth capped at 100, 3 lookahead tokens.

    The first hop is padded so that the first chunk boundary, counted from the start of the *prompt*
    tokens, lands on the flow's 25-token attention-chunk grid; later hops are multiples of it, so every
    non-final flow call ends on a chunk boundary and reproduces the frames of a longer call.
    """

    prompt_tokens: int = 0
    first_hop: int = 25
    grid: int = 25
    max_hop: int = 100
    growth: int = 2
    lookahead: int = 3

    def __post_init__(self) -> None:
        if self.first_hop < 4:
            # the HiFT cache withholds 8 mel frames = 4 tokens; a smaller first chunk has nothing to emit
            raise ValueError(f"first_hop must be >= 4 tokens, got {self.first_hop}")
        if self.prompt_tokens < 0 or self.grid < 1 or self.max_hop < self.first_hop or self.growth < 1:
            raise ValueError(f"inconsistent chunk schedule {self}")

    @property
    def prompt_pad(self) -> int:
        """Extra tokens in the first hop that align its end to the grid (0 when the prompt is aligned)."""
        return -self.prompt_tokens % self.grid

    def hop(self, index: int) -> int:
        """Tokens emitted by non-final chunk number `index` (0-based)."""
        base = min(self.max_hop, self.first_hop * self.growth**index)
        return base + (self.prompt_pad if index == 0 else 0)

    def next_chunk(self, start: int, index: int, available: int, finished: bool) -> Chunk | None:
        """The chunk to run now for a stream at (`start`, `index`) with `available` tokens, or None to wait.

        A non-final chunk runs as soon as its hop plus the lookahead is available (also after the LLM has
        finished); once the LLM has finished and that is no longer possible, the rest forms the final chunk.
        """
        hop = self.hop(index)
        if available - start >= hop + self.lookahead:
            return Chunk(start=start, stop=start + hop, feed=start + hop + self.lookahead, final=False)
        if finished:
            return Chunk(start=start, stop=available, feed=available, final=True)
        return None

    def chunks(self, n_tokens: int) -> list[Chunk]:
        """All chunks of a stream of `n_tokens` tokens (the same whether tokens arrive at once or one by one)."""
        out: list[Chunk] = []
        start = 0
        while True:
            chunk = self.next_chunk(start, len(out), n_tokens, finished=True)
            assert chunk is not None  # finished=True always yields a chunk
            out.append(chunk)
            if chunk.final:
                return out
            start = chunk.stop
