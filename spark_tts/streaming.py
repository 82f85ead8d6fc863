"""Streaming vocoding that gives one continuous waveform equal to the offline one.

BiCodec's decoder is non-causal: a waveform sample depends on the semantic tokens up to ``receptive_radius``
tokens on either side (prenet ConvNeXt stacks: 3 tokens per 7-tap conv; wave generator: its first conv, the
transposed convs and the dilated residual units, converted to token units). The served upstream runtime vocodes
each chunk alone and sends chunks that overlap by 0.1 s and differ from the offline waveform near every cut (by
up to 1.5 on the test model), leaving the client to cross-fade them.

Here each chunk covers tokens ``[start, end)`` and is vocoded over the window
``[start - left_context, end + right_context)`` (clipped to the tokens of the utterance); only the samples of
``[start, end)`` are sent. With both contexts at least ``receptive_radius``, every sent sample sees exactly the
tokens the offline decoder sees, so the concatenated chunks equal the offline waveform up to float rounding
(``tests/spark/test_streaming.py``); clients just concatenate. The right context is paid in latency (the chunk
waits for ``right_context`` more tokens); a smaller one trades exactness near the cuts for an earlier chunk.

Chunk sizes follow the served runtime's schedule: ``first_chunk_tokens`` (50 = 1 s), then ``scale`` times the
previous size (8), at most ``max_chunk_tokens`` (1500); the rest is flushed when the LLM stops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from spark_tts.config import BiCodecConfig


def receptive_radius(config: BiCodecConfig) -> int:
    """Tokens on each side that can influence a waveform sample (an upper bound, rounded up)."""
    pre = config.prenet
    # per resample stage: embed + 2 ConvNeXt dwconvs; main stack: embed + one dwconv per layer; 3 tokens each
    radius_tokens = 3.0 * (3 * len(pre.sample_ratios) + pre.vocos_num_layers + 1)
    wave = config.decoder
    radius_tokens += 3.0  # the generator's first 7-tap conv, at the token rate
    rate = 1
    for kernel, stride in zip(wave.kernel_sizes, wave.rates):
        radius_tokens += math.ceil(kernel / stride) / rate  # transposed conv, in its input samples
        rate *= stride
        radius_tokens += 3 * (1 + 3 + 9) / rate  # residual units: 7 taps at dilations 1, 3, 9
    radius_tokens += 3 / rate  # final 7-tap conv
    return math.ceil(radius_tokens)


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk sizes in tokens (defaults: the served runtime's 1 s first chunk, x8 growth, 30 s cap)."""

    first_chunk_tokens: int = 50
    scale: float = 8.0
    max_chunk_tokens: int = 1500

    def __post_init__(self) -> None:
        if self.first_chunk_tokens < 1 or self.scale < 1 or self.max_chunk_tokens < self.first_chunk_tokens:
            raise ValueError("need first_chunk_tokens >= 1, scale >= 1, max_chunk_tokens >= first_chunk_tokens")

    def next_size(self, size: int) -> int:
        return min(self.max_chunk_tokens, int(size * self.scale))


def upstream_chunk_ranges(num_tokens: int, schedule: ChunkSchedule = ChunkSchedule(), overlap: int = 5
                          ) -> list[tuple[int, int]]:
    """The token ranges the served upstream runtime vocodes separately (chunks overlapping by ``overlap``
    tokens; the remainder, overlap included, flushed at the end). For comparison and tests only."""
    ranges, start, size = [], 0, schedule.first_chunk_tokens
    while num_tokens - start >= size:
        ranges.append((start, start + size))
        start += size - overlap
        size = schedule.next_size(size)
    if num_tokens > start:
        ranges.append((start, num_tokens))
    return ranges


@dataclass(frozen=True)
class Window:
    """One piece of a stream: vocode tokens ``[lo, hi)``, send the samples of tokens ``[start, end)``."""

    lo: int
    hi: int
    start: int
    end: int

    def crop(self, wave: np.ndarray, hop: int) -> np.ndarray:
        """The samples to send, from the waveform of tokens ``[lo, hi)``."""
        if wave.size != (self.hi - self.lo) * hop:
            raise RuntimeError(f"vocoder returned {wave.size} samples for {self.hi - self.lo} tokens (hop {hop})")
        return wave[(self.start - self.lo) * hop:(self.end - self.lo) * hop]


class StreamPlan:
    """Which windows of a token stream to vocode, and when (no vocoding here: a server can batch the windows of
    many streams into one ``vocode_batch`` call)."""

    def __init__(self, radius: int, schedule: ChunkSchedule = ChunkSchedule(), left_context: int | None = None,
                 right_context: int | None = None) -> None:
        self.schedule = schedule
        self.left_context = radius if left_context is None else left_context
        self.right_context = radius if right_context is None else right_context
        if self.left_context < 0 or self.right_context < 0:
            raise ValueError("contexts must be >= 0")
        self.emitted = 0  # tokens whose audio is planned
        self._size = schedule.first_chunk_tokens
        self.finished = False

    def _window(self, end: int, available: int) -> Window:
        window = Window(max(0, self.emitted - self.left_context), min(available, end + self.right_context),
                        self.emitted, end)
        self.emitted = end
        return window

    def advance(self, available: int) -> list[Window]:
        """``available`` tokens exist so far: the windows that are now complete (right context included)."""
        if self.finished:
            raise RuntimeError("stream already finished")
        windows = []
        while available >= self.emitted + self._size + self.right_context:
            windows.append(self._window(self.emitted + self._size, available))
            self._size = self.schedule.next_size(self._size)
        return windows

    def finish(self, total: int) -> list[Window]:
        """The utterance ended with ``total`` tokens: the window of the rest, if any."""
        self.finished = True
        return [self._window(total, total)] if total > self.emitted else []


Vocode = Callable[[Sequence[int]], np.ndarray]


class StreamVocoder:
    """Feed semantic tokens as the LLM produces them; get waveform pieces that concatenate to the utterance.

    ``vocode(tokens)`` must return ``len(tokens) * hop`` samples (one utterance's decoder with its global tokens).
    """

    def __init__(self, vocode: Vocode, hop: int, radius: int, schedule: ChunkSchedule = ChunkSchedule(),
                 left_context: int | None = None, right_context: int | None = None) -> None:
        self._vocode, self.hop = vocode, hop
        self.plan = StreamPlan(radius, schedule, left_context, right_context)
        self.tokens: list[int] = []

    def _piece(self, window: Window) -> np.ndarray:
        wave = np.asarray(self._vocode(self.tokens[window.lo:window.hi]), dtype=np.float32).reshape(-1)
        return window.crop(wave, self.hop)

    def push(self, tokens: Sequence[int]) -> Iterator[np.ndarray]:
        """Add tokens; yield every chunk that is now complete (its right context included)."""
        if self.plan.finished:
            raise RuntimeError("stream already finished")
        self.tokens.extend(int(t) for t in tokens)
        for window in self.plan.advance(len(self.tokens)):
            yield self._piece(window)

    def finish(self) -> Iterator[np.ndarray]:
        """The utterance ended: yield the rest (possibly several pieces' worth in one)."""
        for window in self.plan.finish(len(self.tokens)):
            yield self._piece(window)
