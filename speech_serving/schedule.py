"""The streaming chunk schedule of a deployment, built in one place.

Both ends of a stream use it: the orchestrator cuts the LLM's tokens into chunks by it, token2wav keeps its
flow caches by it. They run in different processes, so each builds it from the same rendered parameters
(`StreamScheduleParams`), and always through this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cosyvoice2.streaming import ChunkSchedule

if TYPE_CHECKING:  # only its `schedule` method is called: reading the parameters needs no engine config module
    from cosyvoice2.config import EngineConfig


@dataclass(frozen=True)
class StreamScheduleParams:
    """The deployment's choices on top of the engine's schedule: the first chunk's tokens, the hop growth, and
    whether the first hop is padded so that its end lands on the flow's attention grid."""

    first_hop: int = 25
    chunk_growth: int = 2
    #: Upstream pads the first hop by (-prompt tokens) mod 25 (0-24 tokens, 12 on average), so every non-final
    #: chunk ends on the grid. Unpadded, the first chunk needs exactly `first_hop` + 3 tokens from the LLM - fewer
    #: decode steps before the first audio - and a chunk that ends inside a grid chunk only caches the whole grid
    #: chunks it completed: the next chunk recomputes the partial one (docs/engine.md, "Off-grid hops").
    align_first_hop: bool = True

    def schedule(self, engine: EngineConfig) -> ChunkSchedule:
        """The engine's schedule with this first hop and growth; `prompt_tokens` is set per stream (`for_prompt`)."""
        base = engine.schedule(0)
        return replace(
            base, first_hop=self.first_hop, growth=self.chunk_growth, max_hop=max(self.first_hop, base.max_hop),
            grid=base.grid if self.align_first_hop else 1,  # the schedule's grid only sets the first hop's pad
        )


def for_prompt(schedule: ChunkSchedule, prompt_tokens: int) -> ChunkSchedule:
    """The schedule of one stream whose voice prompt has `prompt_tokens` speech tokens (its first hop aligns to them)."""
    return replace(schedule, prompt_tokens=prompt_tokens)
