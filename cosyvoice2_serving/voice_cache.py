"""Bounded LRU of voice prompts keyed by voice id, computed once per voice (single-flight).

The key is the gateway's content hash of (reference audio, transcript), never a transcript or a name,
so two voices that share a transcript cannot collide (upstream keyed by text and never evicted).
Concurrent misses for one key share a single computation, which finishes even if the request that
started it is cancelled; a failed computation is not cached.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Awaitable, Callable, Generic, TypeVar

from cosyvoice2_serving.stats import Stats

V = TypeVar("V")

CACHE_STATS = ("voice_cache_hits_total", "voice_cache_misses_total", "voice_cache_entries")


class VoicePromptCache(Generic[V]):
    def __init__(self, capacity: int, stats: Stats | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"voice cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.stats = stats or Stats(CACHE_STATS)
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._pending: dict[str, asyncio.Task[V]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, voice_id: str) -> bool:
        return voice_id in self._entries

    async def get(self, voice_id: str, compute: Callable[[], Awaitable[V]]) -> V:
        """The cached prompt for `voice_id`, computing it with `compute()` on a miss."""
        if voice_id in self._entries:
            self._entries.move_to_end(voice_id)
            self.stats.add("voice_cache_hits_total")
            return self._entries[voice_id]
        task = self._pending.get(voice_id)
        if task is None:
            self.stats.add("voice_cache_misses_total")
            task = asyncio.ensure_future(self._compute(voice_id, compute))
            self._pending[voice_id] = task
        else:  # another request is computing this voice right now: share its result
            self.stats.add("voice_cache_hits_total")
        # shield: a cancelled requester must not abort the computation the others wait for
        return await asyncio.shield(task)

    async def _compute(self, voice_id: str, compute: Callable[[], Awaitable[V]]) -> V:
        try:
            value = await compute()
            self._insert(voice_id, value)
            return value
        finally:
            del self._pending[voice_id]

    def _insert(self, voice_id: str, value: V) -> None:
        self._entries[voice_id] = value
        self._entries.move_to_end(voice_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        self.stats.set("voice_cache_entries", len(self._entries))
