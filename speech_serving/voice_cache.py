"""Bounded LRU of voice prompts keyed by voice id, computed once per voice (single-flight).

The key is the gateway's content hash of (reference audio, transcript), never a transcript or a name,
so two voices that share a transcript cannot collide (upstream keyed by text and never evicted), and a voice
replaced under its name gets a new key. Concurrent misses for one key share a single computation, which
finishes even if the request that started it is cancelled; a failed computation is not cached.

A cache holds one model's prompts (a CosyVoice2 prompt is not a Spark-TTS one): every pipeline keeps its own, in
its voice-prompt model (shared by its offline and streaming models) and in each orchestrator (`VoicePrompts`: a
voice held there costs a request no model call at all). An id-only request (the contract's voice named by
`voice_id` alone) is answered from a cache or refused as `UnknownVoice`, never computed.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Awaitable, Callable, Generic, TypeVar

from speech_serving.errors import UnknownVoice
from speech_serving.stats import Stats
from pipeline_contract import SpeechRequest

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

    async def find(self, voice_id: str, lookup: Callable[[], Awaitable[V]]) -> V:
        """For a request without the voice's audio: the cached prompt, else the one being computed now, else
        `lookup()`'s (cached when it succeeds). A lookup is never shared: it may fail (`UnknownVoice`) where a
        computation from audio, which others may be waiting for, would not."""
        if voice_id in self._entries or voice_id in self._pending:
            return await self.get(voice_id, lookup)  # a hit or a computation under way: `lookup` is not called
        self.stats.add("voice_cache_misses_total")
        value = await lookup()
        self._insert(voice_id, value)
        return value

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


def unknown_voice(voice_id: str) -> Callable[[], Awaitable[V]]:
    """The `find` lookup of the last cache on a voice's way: nobody else to ask, the voice is unknown."""

    async def refuse() -> V:
        raise UnknownVoice.of(voice_id)

    return refuse


class VoicePrompts(Generic[V]):
    """An orchestrator's voice prompts: its own cache in front of the pipeline's voice-prompt model.

    A voice held here costs a request no call at all. Otherwise `fetch(request)` asks the voice-prompt model: with
    the request's audio it computes the prompt (or finds it in the model's cache, which the pipeline's offline and
    streaming orchestrators share); an id-only request is looked up there and fails with `UnknownVoice` if the
    model does not hold the voice either.
    """

    def __init__(self, capacity: int, fetch: Callable[[SpeechRequest], Awaitable[V]]) -> None:
        self.cache: VoicePromptCache[V] = VoicePromptCache(capacity)
        self._fetch = fetch

    async def prompt(self, request: SpeechRequest) -> V:
        fetch = lambda: self._fetch(request)  # noqa: E731 - one request's call, deferred until a miss
        if request.carries_audio:
            return await self.cache.get(request.voice_id, fetch)
        return await self.cache.find(request.voice_id, fetch)
