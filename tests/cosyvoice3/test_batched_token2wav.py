"""`CosyVoice3Token2Wav.run_chunks` batches the flow of a call's chunks (cached streams and offline jobs: one
estimator pass per Euler step for all of them): each stream's mel and audio equal the same stream run alone
(`CosyVoice3Stream.run`), for calls mixing first, later and final chunks of streams of different voices and
histories, offline jobs and streams on the reference (recompute) path; a call that raises changes no stream.
CPU, fp32, the tiny random model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from cosyvoice3.errors import CosyVoice3InputError
from cosyvoice3.token2wav import CosyVoice3Stream, CosyVoice3Token2Wav, FlowCache, FlowRow, batched_solve
from tests.cosyvoice3.conftest import (AUDIO_OF_SCALE, MEL_ATOL, make_voice, open_stream, run_rounds,
                                      stream_tokens)

#: a short prompt (its voice cache holds no complete chunk) and a long one (two complete 50-frame chunks)
VOICES = {"short": make_voice(1, 20), "long": make_voice(2, 56)}


@dataclass(frozen=True)
class Plan:
    """One stream of a test: its voice, tokens, whether it is cached, the round of its first chunk."""

    voice: str
    tokens: int
    cached: bool = True
    first_round: int = 0
    seed: int = 0


def tokens_of(plan: Plan) -> list[int]:
    return stream_tokens(plan.seed, plan.tokens)


def open_plan(token2wav: CosyVoice3Token2Wav, plan: Plan) -> CosyVoice3Stream:
    return open_stream(token2wav, VOICES[plan.voice], tokens_of(plan), plan.cached)


def alone(token2wav: CosyVoice3Token2Wav, plan: Plan) -> tuple[list[np.ndarray], torch.Tensor]:
    """The stream run chunk by chunk on its own: its pieces and its whole mel."""
    stream = open_plan(token2wav, plan)
    pieces, mels = [], []
    while not stream.finished:
        pieces.append(stream.run(stream.next_chunk(finished=True)))
        mels.append(stream.last_mel)
    return pieces, torch.cat(mels, dim=2)


def assert_close(ours: np.ndarray | torch.Tensor, theirs: np.ndarray | torch.Tensor, atol: float, what: str) -> None:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol, err_msg=what)


def assert_audio_close(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    assert_close(ours, theirs, AUDIO_OF_SCALE * float(np.abs(theirs).max(initial=0.0)), what)


COMPOSITIONS = {
    # first chunks beside later ones, streams of both voices, finals while others are mid-stream
    "staggered": [Plan("short", 120, first_round=0, seed=1), Plan("long", 80, first_round=1, seed=2),
                  Plan("long", 45, first_round=2, seed=3), Plan("short", 18, first_round=0, seed=4)],
    # a recompute (reference) stream and a cached one of the same tokens side by side, plus a short stream whose
    # only chunk is final (fewer tokens than a first chunk needs)
    "with_reference": [Plan("long", 70, cached=False, seed=5), Plan("long", 70, seed=5),
                       Plan("short", 9, first_round=1, seed=6), Plan("short", 95, first_round=3, seed=7)],
}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_batched_rounds_equal_each_stream_alone(token2wav: CosyVoice3Token2Wav, name: str) -> None:
    """Rounds of calls, one chunk of each live stream per call, an offline job in every second call."""
    plans = COMPOSITIONS[name]
    streams = [open_plan(token2wav, plan) for plan in plans]
    jobs: list[Plan] = []
    offline: list[tuple[Plan, np.ndarray]] = []

    def offline_job(round_: int) -> list:
        if round_ % 2:
            return []
        jobs.append(Plan("long" if round_ % 4 else "short", 20 + 7 * round_, seed=50 + round_))
        return [token2wav.offline_job(tokens_of(jobs[-1]), VOICES[jobs[-1].voice])]

    def keep_offline(round_: int, out: list) -> None:
        offline.extend(zip(jobs[len(offline):], out, strict=True))  # each call's job, its one extra output

    rounds = run_rounds(token2wav, streams, [plan.first_round for plan in plans], offline_job, keep_offline)
    pieces, mels = rounds.pieces, rounds.mels
    assert any(len(p) > 2 for p in pieces)
    for plan, ours, our_mels in zip(plans, pieces, mels):
        theirs, mel = alone(token2wav, plan)
        assert_close(torch.cat(our_mels, dim=2), mel, MEL_ATOL, f"{plan} mel")
        assert [p.shape for p in ours] == [p.shape for p in theirs], plan
        assert_audio_close(np.concatenate(ours), np.concatenate(theirs), f"{plan} audio")
        assert np.concatenate(ours).shape == (plan.tokens * token2wav.samples_per_token,)
    for plan, audio in offline:
        assert_audio_close(audio, token2wav.offline(tokens_of(plan), VOICES[plan.voice]), f"offline {plan}")


def test_a_batched_call_is_all_or_nothing(token2wav: CosyVoice3Token2Wav) -> None:
    """A bad row (tokens outside the flow vocabulary) fails the whole call before any stream changes; the same
    streams then run the call without it, as if it had never been tried."""
    plans = [Plan("long", 60, seed=8), Plan("short", 40, seed=9)]
    streams = [open_plan(token2wav, plan) for plan in plans]
    token2wav.run_chunks([(s, s.next_chunk(finished=True)) for s in streams])  # each now holds a flow cache
    mels = [[s.last_mel] for s in streams]
    caches = [s.flow_cache for s in streams]
    bad = token2wav.open_stream(VOICES["short"], cached=True)
    bad.extend([1, 2, token2wav.flow.config.vocab_size + 1, 3, 4, 5, 6])
    work = [(s, s.next_chunk(finished=True)) for s in streams]
    with pytest.raises(CosyVoice3InputError):
        token2wav.run_chunks([*work, (bad, bad.next_chunk(finished=True))])
    assert [s.flow_cache for s in streams] == caches and [len(s.chunks) for s in streams] == [1, 1]
    with pytest.raises(ValueError, match="one chunk per stream"):
        token2wav.run_chunks([work[0], work[0]])
    token2wav.run_chunks(work)
    for stream, stream_mels in zip(streams, mels):
        stream_mels.append(stream.last_mel)
    for stream_mels, rest in zip(mels, run_rounds(token2wav, streams).mels):
        stream_mels.extend(rest)
    for plan, our_mels in zip(plans, mels):
        assert_close(torch.cat(our_mels, dim=2), alone(token2wav, plan)[1], MEL_ATOL, f"{plan} mel")


@torch.inference_mode()
def test_padded_rows_see_only_their_own_frames(token2wav: CosyVoice3Token2Wav) -> None:
    """`batched_solve` itself: rows of different histories, lengths and attention modes give, row by row, the
    mel and cache of the row solved alone (a padded frame that leaked into a row would change its numbers far
    beyond rounding)."""
    flow = token2wav.flow
    long = token2wav.open_stream(VOICES["long"], cached=True)
    long.extend(tokens_of(Plan("long", 60, seed=10)))
    long.run(long.next_chunk(finished=True))  # a history of committed chunks
    rows = [long.flow_row(long.next_chunk(finished=True)),
            FlowRow(token2wav.flow_inputs(tokens_of(Plan("short", 11, seed=11)), VOICES["short"], finalize=False),
                    FlowCache(), streaming=True),
            FlowRow(token2wav.flow_inputs(tokens_of(Plan("short", 33, seed=12)), VOICES["short"], finalize=True),
                    FlowCache(), streaming=False)]
    together = batched_solve(flow, rows)
    for row, (mel, cache) in zip(rows, together):
        mel_alone, cache_alone = batched_solve(flow, [row])[0]
        assert_close(mel, mel_alone, MEL_ATOL, "mel")
        assert cache.committed == cache_alone.committed
        for step, step_alone in zip(cache.kv, cache_alone.kv):
            assert_close(step, step_alone, MEL_ATOL, "keys and values")
        for c, c1 in zip(cache.context, cache_alone.context):
            assert_close(c, c1, MEL_ATOL, "context")
    with pytest.raises(ValueError, match="full attention"):
        batched_solve(flow, [FlowRow(rows[0].inputs, rows[0].cache, streaming=False)])
