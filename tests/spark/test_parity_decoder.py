"""Vocoder parity with the upstream runtime: d-vector, decoder input, offline waveform and its raw stream chunks
(micro model); the upstream chunk schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_tts.streaming import upstream_chunk_ranges
from tests.spark.conftest import max_abs, needs_parity_data

pytestmark = [pytest.mark.parity, needs_parity_data]


def _tokens(dump) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(dump["voc_semantic_tokens"]).long(), torch.from_numpy(dump["voc_global_tokens"]).long())


def test_vocoder_inputs_are_the_tokenizer_and_teacher_tokens(dump) -> None:
    assert np.array_equal(dump["voc_global_tokens"], dump["at_global_tokens"])
    assert np.array_equal(dump["voc_semantic_tokens"], dump["in_teacher_semantic"])


def test_d_vector_and_decoder_input(engine, dump) -> None:
    semantic, global_ = _tokens(dump)
    assert max_abs(engine.bicodec.d_vector(global_), dump["voc_d_vector"]) < 1e-5
    assert max_abs(engine.bicodec.decoder_input(semantic, global_), dump["voc_decoder_input"]) < 3e-5


def test_offline_waveform(engine, dump) -> None:
    semantic, global_ = _tokens(dump)
    wave = engine.bicodec.detokenize(semantic, global_)
    assert wave.shape == (1, 320 * semantic.shape[1])
    assert max_abs(wave, dump["voc_wave_offline"]) < 1e-4
    assert max_abs(engine.vocode(global_[0].tolist(), semantic[0].tolist())[None], dump["voc_wave_offline"]) < 1e-4


def test_upstream_stream_chunks_and_schedule(engine, dump) -> None:
    ranges = upstream_chunk_ranges(dump["voc_semantic_tokens"].shape[1])
    assert ranges == [tuple(r) for r in dump["voc_stream_token_ranges"].tolist()]
    assert upstream_chunk_ranges(512) == [tuple(r) for r in dump["voc_stream_schedule_512"].tolist()]
    global_, semantic = dump["voc_global_tokens"][0].tolist(), dump["voc_semantic_tokens"][0].tolist()
    for index, (start, end) in enumerate(ranges):
        assert max_abs(engine.vocode(global_, semantic[start:end])[None], dump[f"voc_stream_chunk{index}"]) < 1e-4
