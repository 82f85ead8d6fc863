"""`final_over_cache` (render option `--cosyvoice3-flow-cache chunked`): a cached stream's final chunk continues its
flow cache under the chunk mask instead of recomputing the prompt and every token with full attention.

Its frames must be exactly the chunk-mask solve of the stream's tokens with the final token features (what the
recompute path computes for that chunk with the chunk mask), its non-final chunks those of the default cached
path; it must batch with other streams' chunks and offline jobs as it runs alone, keep 960 samples per token, and
fit the step graphs' buckets made for it. CPU, fp32, the tiny random model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosyvoice3.graphs import FlowStepGraphs
from cosyvoice3.token2wav import CosyVoice3Token2Wav, FlowCache, batched_solve, runtime_schedule
from tests.cosyvoice3.conftest import AUDIO_OF_SCALE, MEL_ATOL, make_voice, open_stream, run_rounds, stream_tokens
from tests.cosyvoice3.test_flow_graphs import recording

#: a prompt whose voice cache holds a complete 50-frame chunk, and one that holds none
VOICES = {"long": make_voice(2, 56), "short": make_voice(1, 20)}


@pytest.fixture(scope="module")
def chunked(tiny_parts) -> CosyVoice3Token2Wav:
    return CosyVoice3Token2Wav(*tiny_parts, final_over_cache=True)


def run_alone(token2wav: CosyVoice3Token2Wav, voice: str, tokens: list[int]):
    """The stream's chunks, one `run` each: (chunks, mels, audio pieces)."""
    stream = open_stream(token2wav, VOICES[voice], tokens)
    chunks, mels, pieces = [], [], []
    while not stream.finished:
        chunk = stream.next_chunk(finished=True)
        pieces.append(stream.run(chunk))
        chunks.append(chunk)
        mels.append(stream.last_mel)
    return chunks, mels, pieces


@pytest.mark.parametrize("voice, count", [("long", 47), ("short", 80)])
def test_the_final_chunk_is_the_chunk_mask_solve_with_final_features(chunked, token2wav, voice, count):
    tokens = stream_tokens(count, count)
    chunks, mels, pieces = run_alone(chunked, voice, tokens)
    assert len(chunks) >= 2 and chunks[-1].final and chunks[-1].start > 0
    ratio = chunked.flow.config.token_mel_ratio
    prompt = VOICES[voice]
    for chunk, mel in zip(chunks, mels):
        # the recompute path's chunk with the chunk mask; final token features on the final chunk only
        expected = chunked.mel(tokens[: chunk.feed], prompt, streaming=True, finalize=chunk.final)
        torch.testing.assert_close(mel, expected[:, :, ratio * chunk.start:], rtol=0, atol=MEL_ATOL)
    assert sum(piece.size for piece in pieces) == len(tokens) * chunked.samples_per_token
    # the default engine cuts the same chunks and computes the same non-final ones
    default_chunks, default_mels, _ = run_alone(token2wav, voice, tokens)
    assert default_chunks == chunks
    for mel, default_mel in zip(mels[:-1], default_mels[:-1]):
        torch.testing.assert_close(mel, default_mel, rtol=0, atol=MEL_ATOL)
    # what each solves for the final chunk: its new frames over the cache, or the whole call with full attention
    final = chunks[-1]
    for engine, over_cache in ((chunked, True), (token2wav, False)):
        stream = open_stream(engine, prompt, tokens)
        for chunk in chunks[:-1]:
            stream.run(chunk)
        row = stream.flow_row(final)
        assert row.streaming == over_cache and (row.start > 0) == over_cache
        assert row.new_frames == row.inputs.frames - (stream.flow_cache.committed if over_cache else 0)
        # either way the stream's last call keeps no cache (nothing reads it again)
        assert batched_solve(engine.flow, [row])[0][1] == FlowCache()


def test_final_chunks_over_caches_batch_as_they_run_alone(chunked):
    """Streams ending in different rounds (their final chunks beside other streams' non-final chunks and an
    offline job, which stays a whole call with full attention) give each stream what it gives alone."""
    plans = [("long", 70, 0), ("short", 45, 1), ("long", 90, 0)]
    streams = [open_stream(chunked, VOICES[voice], stream_tokens(seed, count))
               for seed, (voice, count, _) in enumerate(plans)]
    job_tokens = stream_tokens(9, 30)
    offline = []

    def extra(round_: int) -> list:
        return [chunked.offline_job(job_tokens, VOICES["short"])] if round_ == 1 else []

    rounds = run_rounds(chunked, streams, [first for *_, first in plans], extra,
                        on_round=lambda _, out: offline.extend(out))
    for i, (voice, count, _) in enumerate(plans):
        _, mels, _ = run_alone(chunked, voice, stream_tokens(i, count))
        assert len(mels) == len(rounds.mels[i])
        for batched, alone in zip(rounds.mels[i], mels):
            torch.testing.assert_close(batched, alone, rtol=0, atol=MEL_ATOL)
    # the offline job beside them is the whole utterance with full attention, as `offline` gives it
    assert len(offline) == 1
    expected = chunked.offline(job_tokens, VOICES["short"])
    np.testing.assert_allclose(offline[0], expected, rtol=0, atol=AUDIO_OF_SCALE * float(np.abs(expected).max()))


@pytest.mark.parametrize("hops", [(15, 25), (10, 20)])
def test_the_buckets_cover_every_final_chunk_over_a_cache(tiny_parts, hops):
    """Every final chunk a schedule forms (streams ending at every token count within a hop of each chunk index)
    fits the buckets made with `final_over_cache` while its history fits the largest history bucket; the
    default's buckets need not (a stream's final chunk there is a whole call)."""
    schedule = runtime_schedule(*hops, lookahead=tiny_parts[0].config.pre_lookahead_len)
    engine = CosyVoice3Token2Wav(*tiny_parts, schedule=schedule, final_over_cache=True)
    buckets = engine.graph_buckets([schedule])
    graphs = FlowStepGraphs(engine.flow.estimator, buckets)
    graphs.emulate = True
    engine.graphs = graphs
    calls = recording(graphs)
    ends = sorted({sum(schedule.hop(i) for i in range(index)) + extra
                   for index in (1, 2, 3) for extra in range(1, schedule.hop(index) + schedule.lookahead)})
    finals = 0
    for count in ends[:: max(1, len(ends) // 8)] + ends[-1:]:  # a spread of endings, both ends of the range
        before = len(calls)
        chunks, _, _ = run_alone(engine, "long", stream_tokens(count, count))
        if chunks[-1].start == 0:
            continue
        (rows, frames, history), shape = calls[-1]  # the final chunk's solve is the stream's last
        assert len(calls) - before == len(chunks)
        if history <= buckets.history[-1]:
            assert shape is not None, (count, rows, frames, history)
            finals += 1
    assert finals >= 6
