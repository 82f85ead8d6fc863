"""Streaming: chunks vocoded with receptive-field context concatenate to the offline waveform (one continuous
waveform, no client-side cross-fade); the radius is large enough; the chunk schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_tts.streaming import ChunkSchedule, StreamVocoder, receptive_radius
from tests.spark.conftest import max_abs, needs_parity_data

pytestmark = [needs_parity_data]


def _stream(engine, global_tokens, semantic, schedule, right_context=None, step=1):
    vocoder = StreamVocoder(lambda t: engine.vocode(global_tokens, t), engine.hop, engine.radius, schedule,
                            right_context=right_context)
    pieces = []
    for i in range(0, len(semantic), step):
        pieces += list(vocoder.push(semantic[i : i + step]))
    pieces += list(vocoder.finish())
    return pieces


@pytest.fixture(scope="module")
def tokens(dump):
    return dump["voc_global_tokens"][0].tolist(), dump["voc_semantic_tokens"][0].tolist()


def test_radius_matches_the_configuration(engine) -> None:
    assert engine.radius == receptive_radius(engine.bicodec.config) == 39  # micro: 2-layer prenet
    from spark_tts.config import BiCodecConfig

    assert receptive_radius(BiCodecConfig()) == 69  # released: 12-layer prenet


@pytest.mark.parametrize("schedule", [ChunkSchedule(), ChunkSchedule(first_chunk_tokens=10, scale=1.5),
                                      ChunkSchedule(first_chunk_tokens=7, scale=1.0, max_chunk_tokens=7)])
def test_streamed_audio_equals_offline(engine, tokens, schedule) -> None:
    global_, semantic = tokens
    offline = engine.vocode(global_, semantic)
    pieces = _stream(engine, global_, semantic, schedule)
    assert sum(p.size for p in pieces) == offline.size == 320 * len(semantic)
    assert max_abs(np.concatenate(pieces), offline) < 1e-4


def test_first_piece_size_and_wait(engine, tokens) -> None:
    global_, semantic = tokens
    vocoder = StreamVocoder(lambda t: engine.vocode(global_, t), engine.hop, engine.radius, ChunkSchedule(20, 2.0))
    assert list(vocoder.push(semantic[: 20 + engine.radius - 1])) == []  # waits for its right context
    [first] = list(vocoder.push(semantic[20 + engine.radius - 1 : 20 + engine.radius]))
    assert first.size == 20 * 320


def test_short_context_breaks_equality(engine, tokens) -> None:
    """Control: with little right context the pieces differ from offline near the cuts (why the radius matters)."""
    global_, semantic = tokens
    offline = engine.vocode(global_, semantic)
    pieces = _stream(engine, global_, semantic, ChunkSchedule(first_chunk_tokens=20, scale=1.5), right_context=2)
    assert max_abs(np.concatenate(pieces), offline) > 1e-2


def test_tokens_beyond_the_radius_have_no_influence(engine, tokens) -> None:
    global_, semantic = tokens
    changed = list(semantic)
    position = 50
    changed[position] = (changed[position] + 4096) % 8192
    a, b = engine.vocode(global_, semantic), engine.vocode(global_, changed)
    per_token = np.abs(a - b).reshape(-1, 320).max(axis=1)
    far = np.r_[0 : position - engine.radius, position + engine.radius + 1 : len(semantic)]
    assert per_token[far].max() < 1e-5
    assert per_token[position] > 1e-3


def test_stream_of_exactly_one_chunk_and_empty_stream(engine, tokens) -> None:
    global_, semantic = tokens
    pieces = _stream(engine, global_, semantic[:50], ChunkSchedule())
    assert [p.size for p in pieces] == [50 * 320]
    vocoder = StreamVocoder(lambda t: engine.vocode(global_, t), engine.hop, engine.radius)
    assert list(vocoder.finish()) == []
    with pytest.raises(RuntimeError):
        list(vocoder.push([1]))


def test_schedule_validation() -> None:
    with pytest.raises(ValueError):
        ChunkSchedule(first_chunk_tokens=0)
    assert [ChunkSchedule().next_size(s) for s in (50, 400, 1500)] == [400, 1500, 1500]


def test_vocoder_batches_windows_of_any_length(engine, tokens) -> None:
    """Concurrent streams' windows have different lengths: one masked forward gives each its solo waveform."""
    global_, semantic = tokens
    other_global = [(g * 7 + 3) % 4096 for g in global_]
    items = [(global_, semantic[:100]), (other_global, semantic[10:47]), (global_, []), (global_, semantic[60:61])]
    batched = engine.vocode_batch(items)
    for (g, s), wave in zip(items, batched):
        solo = engine.vocode(g, s)
        assert wave.shape == solo.shape == (320 * len(s),)
        if len(s):
            assert max_abs(wave, solo) < 1e-4
    # control: the same padded batch without lengths changes the short rows
    padded = torch.zeros(2, 100, dtype=torch.long)
    padded[0], padded[1, :37] = torch.tensor(semantic[:100]), torch.tensor(semantic[10:47])
    unmasked = engine.bicodec.detokenize(padded, torch.tensor([global_, other_global]))
    assert max_abs(unmasked[1, : 37 * 320], batched[1]) > 1e-3


@pytest.mark.parametrize("prenet_layers", [1, 4])
def test_radius_bounds_the_influence_for_other_depths(prenet_layers: int) -> None:
    """The radius formula follows the prenet depth: a random BiCodec with another depth, perturbed at one token,
    changes nothing beyond the radius."""
    from dataclasses import replace

    from spark_tts.codec.bicodec import BiCodec
    from spark_tts.testing import TINY_WIDTHS, tiny_bicodec_config

    config = tiny_bicodec_config()
    config = replace(config, prenet=replace(config.prenet, vocos_num_layers=prenet_layers))
    radius = receptive_radius(config)
    assert radius == 3 * (3 * 2 + prenet_layers + 1) + 12
    torch.manual_seed(0)
    model = BiCodec(config, TINY_WIDTHS).eval()
    length, position = 2 * radius + 30, radius + 15
    semantic = torch.randint(0, 8192, (1, length))
    changed = semantic.clone()
    changed[0, position] = (changed[0, position] + 4096) % 8192
    global_ = torch.randint(0, 4096, (1, 32))
    with torch.no_grad():
        diff = (model.detokenize(semantic, global_) - model.detokenize(changed, global_)).abs()
    per_token = diff.reshape(length, 320).max(dim=1).values
    outside = torch.cat([per_token[: position - radius], per_token[position + radius + 1 :]])
    assert outside.max() < 1e-6 and per_token[position] > 1e-4


def test_plans_of_many_streams_vocoded_in_one_batch(engine, tokens) -> None:
    """The server-side pattern: several streams' ready windows vocoded together still give offline audio."""
    from spark_tts.streaming import StreamPlan

    global_, semantic = tokens
    streams = [(global_, semantic), ([(g + 1) % 4096 for g in global_], semantic[::-1][:83])]
    plans = [StreamPlan(engine.radius, ChunkSchedule(first_chunk_tokens=15, scale=2.0)) for _ in streams]
    sent: list[list[np.ndarray]] = [[], []]
    longest = max(len(s) for _, s in streams)
    for available in range(1, longest + 2):
        jobs = []
        for index, ((g, s), plan) in enumerate(zip(streams, plans)):
            if plan.finished:
                continue
            windows = plan.finish(len(s)) if available > len(s) else plan.advance(available)
            jobs += [(index, w) for w in windows]
        waves = engine.vocode_batch([(streams[i][0], streams[i][1][w.lo : w.hi]) for i, w in jobs])
        for (index, window), wave in zip(jobs, waves):
            sent[index].append(window.crop(wave, engine.hop))
    for (g, s), pieces in zip(streams, sent):
        assert max_abs(np.concatenate(pieces), engine.vocode(g, s)) < 1e-4
