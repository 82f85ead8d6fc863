"""VoicePromptCache: LRU bound, single flight, failures not cached, cancellation-safe; lookups by id alone."""

from __future__ import annotations

import asyncio

import pytest

from speech_serving.errors import UnknownVoice
from speech_serving.voice_cache import VoicePromptCache, unknown_voice


async def test_hits_misses_and_lru_eviction():
    cache: VoicePromptCache[str] = VoicePromptCache(capacity=2)
    computed: list[str] = []

    def compute(key):
        async def run():
            computed.append(key)
            return key.upper()

        return run

    assert await cache.get("a", compute("a")) == "A"
    assert await cache.get("b", compute("b")) == "B"
    assert await cache.get("a", compute("a")) == "A"  # hit; "a" is now the most recent
    assert await cache.get("c", compute("c")) == "C"  # evicts "b", the least recent
    assert "b" not in cache and "a" in cache and len(cache) == 2
    assert await cache.get("b", compute("b")) == "B"
    assert computed == ["a", "b", "c", "b"]
    stats = cache.stats.snapshot()
    assert (stats["voice_cache_hits_total"], stats["voice_cache_misses_total"], stats["voice_cache_entries"]) == (1, 4, 2)


async def test_concurrent_misses_compute_once():
    cache: VoicePromptCache[int] = VoicePromptCache(capacity=4)
    calls = 0
    gate = asyncio.Event()

    async def compute():
        nonlocal calls
        calls += 1
        await gate.wait()
        return 7

    waiters = [asyncio.create_task(cache.get("v", compute)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiters) == [7] * 5
    assert calls == 1


async def test_failure_is_not_cached_and_is_raised_to_every_waiter():
    cache: VoicePromptCache[int] = VoicePromptCache(capacity=4)

    async def broken():
        await asyncio.sleep(0)
        raise RuntimeError("tokenizer down")

    results = await asyncio.gather(cache.get("v", broken), cache.get("v", broken), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert "v" not in cache

    async def fine():
        return 3

    assert await cache.get("v", fine) == 3


async def test_cancelled_first_requester_does_not_abort_the_shared_computation():
    cache: VoicePromptCache[int] = VoicePromptCache(capacity=4)
    gate = asyncio.Event()

    async def compute():
        await gate.wait()
        return 5

    first = asyncio.create_task(cache.get("v", compute))
    await asyncio.sleep(0)
    second = asyncio.create_task(cache.get("v", compute))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert await second == 5
    with pytest.raises(asyncio.CancelledError):
        await first
    assert "v" in cache


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        VoicePromptCache(capacity=0)


async def test_find_answers_from_the_cache_or_a_computation_under_way_and_looks_up_only_otherwise():
    cache: VoicePromptCache[int] = VoicePromptCache(capacity=4)
    lookups: list[str] = []

    def lookup(key, value):
        async def run():
            lookups.append(key)
            return value

        return run

    gate = asyncio.Event()

    async def slow():
        await gate.wait()
        return 1

    computing = asyncio.create_task(cache.get("a", slow))
    await asyncio.sleep(0)
    finding = asyncio.create_task(cache.find("a", lookup("a", 99)))  # shares the computation from audio
    await asyncio.sleep(0)
    gate.set()
    assert (await computing, await finding) == (1, 1)
    assert await cache.find("a", lookup("a", 99)) == 1  # held
    assert await cache.find("b", lookup("b", 2)) == 2  # not held: looked up, then held
    assert await cache.find("b", lookup("b", 3)) == 2
    assert lookups == ["b"]
    stats = cache.stats.snapshot()
    assert (stats["voice_cache_hits_total"], stats["voice_cache_misses_total"]) == (3, 2)


async def test_a_failed_lookup_is_neither_cached_nor_shared():
    cache: VoicePromptCache[int] = VoicePromptCache(capacity=4)
    gate = asyncio.Event()

    async def unknown():
        await gate.wait()
        raise UnknownVoice.of("v")

    async def compute():
        return 4

    finding = asyncio.create_task(cache.find("v", unknown))
    await asyncio.sleep(0)
    computing = asyncio.create_task(cache.get("v", compute))  # carries the audio: computes on its own
    assert await computing == 4
    gate.set()
    with pytest.raises(UnknownVoice, match=r"^\[unknown_voice\]"):
        await finding
    assert await cache.find("v", unknown_voice("v")) == 4  # held now


async def test_unknown_voice_is_the_last_caches_answer():
    cache: VoicePromptCache[int] = VoicePromptCache(capacity=4)
    with pytest.raises(UnknownVoice, match="'nobody'"):
        await cache.find("nobody", unknown_voice("nobody"))
    assert "nobody" not in cache
