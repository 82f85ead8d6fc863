"""The streaming chunk schedule of a deployment, built in one place.

Both ends of a stream use it: the orchestrator cuts the LLM's tokens into chunks by it, token2wav keeps its
flow caches by it. They run in different processes, so each builds it from the same rendered parameters
(`StreamScheduleParams`), and always through this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

from cosyvoice2.streaming import ChunkSchedule

if TYPE_CHECKING:  # only its `schedule` method is called: reading the parameters needs no engine config module
    from cosyvoice2.config import EngineConfig


#: When a stream's first hop is padded to the flow's grid (`StreamScheduleParams.align_first_hop`).
FIRST_HOP_ALIGNMENTS = ("always", "busy", "never")


@dataclass(frozen=True)
class StreamScheduleParams:
    """The deployment's choices on top of the engine's schedule: the first chunk's tokens, the hop growth, and
    when the first hop is padded so that its end lands on the flow's attention grid."""

    first_hop: int = 25
    chunk_growth: int = 2
    #: Upstream pads the first hop by (-prompt tokens) mod 25 (0-24 tokens, 12 on average), so every non-final
    #: chunk ends on the grid. Unpadded, the first chunk needs exactly `first_hop` + 3 tokens from the LLM - fewer
    #: decode steps before the first audio, but less audio buffered when it plays - and a chunk that ends inside a
    #: grid chunk only caches the whole grid chunks it completed: the next chunk recomputes the partial one
    #: (docs/engine.md, "Off-grid hops"). "always": upstream's schedule; "never": no stream is padded; "busy": only
    #: a stream that starts while `busy_streams` or more streams run (itself counted) is padded.
    align_first_hop: str = "busy"
    #: The first hop of a stream that starts while no other stream runs (None: `first_hop`). A lone stream has the
    #: GPU to itself: fewer tokens before its first chunk are fewer decode steps and a smaller first flow call, and
    #: its later chunks come back long before its first one has played. Streams that start beside others keep
    #: `first_hop`: with many streams a short first chunk plays out before the next one arrives.
    lone_first_hop: int | None = None
    #: Where "busy" starts. Padding buys a longer first chunk to play while the next one is made; a stream only
    #: needs it where the next chunk may come late. On one H200 with 16 rows per token2wav call
    #: (docs/experiments/2026-11-28-four-h200s-settings.md) unpadded first chunks stalled 0-6 % of the streams at 32
    #: and 41-60 % at 64, so 24 was the default. With 32 rows the next chunk comes in time: on one H100 48 took the
    #: first chunk at 32 streams from 427-428 ms p90 to 400-422 with no stall at 16-64 streams and the same open-loop
    #: rate (docs/experiments/2026-12-07-h100-busy-streams.md); at 64 streams most still start padded. The count is
    #: the streaming orchestrator's own requests (one instance by default).
    busy_streams: int = 48

    def __post_init__(self) -> None:
        if self.align_first_hop not in FIRST_HOP_ALIGNMENTS:
            raise ValueError(f"align_first_hop must be one of {FIRST_HOP_ALIGNMENTS}, got {self.align_first_hop!r}")
        if self.lone_first_hop is not None and self.lone_first_hop < 1:
            raise ValueError(f"lone_first_hop must be at least 1 token, got {self.lone_first_hop}")
        if self.busy_streams < 2:
            raise ValueError(f"busy_streams must be at least 2 (a lone stream is never busy), got {self.busy_streams}")

    def schedule(self, engine: EngineConfig) -> ChunkSchedule:
        """The engine's schedule with this first hop and growth; `prompt_tokens` is set per stream (`for_prompt`)."""
        aligned = self._with_first_hop(engine, self.first_hop)
        return unaligned(aligned) if self.align_first_hop == "never" else aligned

    def light_schedule(self, engine: EngineConfig) -> ChunkSchedule | None:
        """The schedule of a stream that starts beside others, but fewer than `busy_streams` in all, where it
        differs from `schedule` (under "busy": the first hop unpadded)."""
        if self.align_first_hop != "busy" or self.busy_streams <= 2:
            return None
        return unaligned(self.schedule(engine))

    def lone_schedule(self, engine: EngineConfig) -> ChunkSchedule | None:
        """The schedule of a stream that starts while no other stream runs, where it differs from `schedule`."""
        lone = self.schedule(engine)
        if self.lone_first_hop is not None and self.lone_first_hop != self.first_hop:
            # only the first hop changes: the second and later hops stay everyone's
            lone = replace(self._with_first_hop(engine, self.lone_first_hop), second_hop=lone.hop(1))
        if self.align_first_hop != "always":
            lone = unaligned(lone)
        return None if lone == self.schedule(engine) else lone

    def _with_first_hop(self, engine: EngineConfig, first_hop: int) -> ChunkSchedule:
        base = engine.schedule(0)
        return replace(base, first_hop=first_hop, growth=self.chunk_growth, max_hop=max(first_hop, base.max_hop))

    def schedules(self, engine: EngineConfig) -> list[ChunkSchedule]:
        """Every schedule a stream may follow (what token2wav's CUDA-graph buckets must cover)."""
        served = (self.schedule(engine), self.light_schedule(engine), self.lone_schedule(engine))
        return list(dict.fromkeys(s for s in served if s is not None))


def unaligned(schedule: ChunkSchedule) -> ChunkSchedule:
    """`schedule` without the first hop's pad (its grid only sets that pad)."""
    return replace(schedule, grid=1)


def for_prompt(schedule: ChunkSchedule, prompt_tokens: int) -> ChunkSchedule:
    """The schedule of one stream whose voice prompt has `prompt_tokens` speech tokens (its first hop aligns to them)."""
    return replace(schedule, prompt_tokens=prompt_tokens)


def for_every_prompt(schedules: Iterable[ChunkSchedule]) -> list[ChunkSchedule]:
    """Each schedule once per alignment of a voice prompt to its grid (the first hops streams of any voice get):
    what CUDA-graph buckets that serve every prompt length are computed from."""
    return [for_prompt(schedule, prompt_tokens) for schedule in schedules for prompt_tokens in range(schedule.grid)]
