"""The memory budget of CosyVoice3's cached streams (`CosyVoice3Token2Wav(cache_budget_bytes=...)`): a stream
whose next flow cache would pass it drops its cache and recomputes from then on, with the audio of the unlimited
run up to float rounding; the accounting counts only the streams' own tensors (not the voice's prompt cache) and
returns to zero at final chunks, `close` and dropped streams; a call that raises accounts nothing.
CPU, fp32, the tiny random model."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from cosyvoice3.errors import CosyVoice3InputError
from cosyvoice3.token2wav import CosyVoice3Stream, CosyVoice3Token2Wav
from tests.cosyvoice3.conftest import run_rounds
from tests.cosyvoice3.test_batched_token2wav import VOICES, Plan, assert_audio_close, open_plan, tokens_of


def engine(parts, budget: int | None) -> CosyVoice3Token2Wav:
    return CosyVoice3Token2Wav(*parts, cache_budget_bytes=budget)


def run_together(token2wav: CosyVoice3Token2Wav, streams: list[CosyVoice3Stream],
                 on_round=None) -> list[np.ndarray]:
    """Rounds of `run_chunks`, one chunk of every live stream per call; each stream's whole audio."""
    rounds = run_rounds(token2wav, streams, on_round=None if on_round is None else lambda *_: on_round())
    return [np.concatenate(p) for p in rounds.pieces]


def own_bytes(streams: list[CosyVoice3Stream]) -> int:
    return sum(stream._flow_cache_bytes for stream in streams)


PLANS = [Plan("short", 130, seed=1), Plan("short", 130, seed=2), Plan("long", 90, seed=3)]


def test_no_budget_keeps_every_cache_and_accounts_own_bytes(tiny_parts) -> None:
    token2wav = engine(tiny_parts, None)
    streams = [open_plan(token2wav, plan) for plan in PLANS]
    peak = []

    def check() -> None:
        assert token2wav.cache_bytes == own_bytes(streams)
        assert all(stream.cached and (stream.flow_cache is None) == stream.finished for stream in streams)
        peak.append(token2wav.cache_bytes)

    run_together(token2wav, streams, check)
    assert max(peak) > 0 and token2wav.cache_bytes == 0


def test_the_voice_prompt_cache_is_not_counted(tiny_parts) -> None:
    """The long voice's first chunk completes no 50-frame chunk beyond its prompt cache: the new cache keeps the
    voice's keys/values (shared, not counted) and only its fresh conv context counts."""
    token2wav = engine(tiny_parts, None)
    voice_cache = token2wav.prompt_flow_cache(VOICES["long"])
    stream = open_plan(token2wav, Plan("long", 90, seed=4))
    stream.run(stream.next_chunk(finished=True))
    cache = stream.flow_cache
    assert cache is not None and cache.kv[0] is voice_cache.kv[0]
    assert token2wav.cache_bytes == sum(c.nbytes for c in cache.context) < cache.nbytes()
    stream.run(stream.next_chunk(finished=True))  # completes a chunk: new keys/values, the stream's own
    assert token2wav.cache_bytes == stream.flow_cache.nbytes() > 0
    stream.finish()
    assert token2wav.cache_bytes == 0


def test_a_tiny_budget_falls_back_to_recompute_with_the_same_audio(tiny_parts) -> None:
    """A budget of one short stream's first cache: the first stream keeps it, the second concurrent one falls back
    at once, the first later (its cache grows); every stream's audio is the unlimited run's."""
    probe = engine(tiny_parts, None)
    first = open_plan(probe, PLANS[0])
    first.run(first.next_chunk(finished=True))
    budget = probe.cache_bytes
    assert budget > 0
    del first

    unlimited = engine(tiny_parts, None)
    theirs = run_together(unlimited, [open_plan(unlimited, plan) for plan in PLANS])
    limited = engine(tiny_parts, budget)
    streams = [open_plan(limited, plan) for plan in PLANS]
    fell_back_at: dict[int, int] = {}
    rounds = []

    def check() -> None:
        rounds.append(None)
        assert limited.cache_bytes == own_bytes(streams) <= budget
        for i, stream in enumerate(streams):
            if not stream.cached:
                fell_back_at.setdefault(i, len(rounds))
                assert stream.flow_cache is None

    ours = run_together(limited, streams, check)
    assert fell_back_at.get(1) == 1  # the second stream of the first call
    assert fell_back_at.get(0, 0) > 1  # the first stream at a later chunk
    assert limited.cache_bytes == 0
    for plan, mine, reference in zip(PLANS, ours, theirs):
        assert mine.shape == reference.shape == (plan.tokens * limited.samples_per_token,)
        assert_audio_close(mine, reference, f"{plan} audio")


def test_close_and_dropped_streams_return_their_bytes(tiny_parts) -> None:
    token2wav = engine(tiny_parts, 1 << 40)
    streams = [open_plan(token2wav, plan) for plan in PLANS]
    token2wav.run_chunks([(s, s.next_chunk(finished=True)) for s in streams])
    token2wav.run_chunks([(s, s.next_chunk(finished=True)) for s in streams])
    held = [s._flow_cache_bytes for s in streams]
    assert all(held) and token2wav.cache_bytes == sum(held)
    streams[0].close()
    assert token2wav.cache_bytes == sum(held[1:]) and streams[0].flow_cache is None and not streams[0].cached
    streams[0].finish()  # a closed stream still finishes, recomputing
    del streams[1:]
    gc.collect()
    assert token2wav.cache_bytes == 0


def test_a_failed_call_accounts_nothing(tiny_parts) -> None:
    token2wav = engine(tiny_parts, 1 << 40)
    streams = [open_plan(token2wav, plan) for plan in PLANS[:2]]
    token2wav.run_chunks([(s, s.next_chunk(finished=True)) for s in streams])
    before = token2wav.cache_bytes
    bad = token2wav.open_stream(VOICES["short"], cached=True)
    bad.extend([1, 2, token2wav.flow.config.vocab_size + 1, *tokens_of(Plan("short", 20, seed=9))])
    with pytest.raises(CosyVoice3InputError):
        token2wav.run_chunks([*[(s, s.next_chunk(finished=True)) for s in streams],
                              (bad, bad.next_chunk(finished=True))])
    assert token2wav.cache_bytes == before == own_bytes(streams) > 0
