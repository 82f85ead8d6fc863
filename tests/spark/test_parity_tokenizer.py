"""Audio tokenizer parity with the upstream runtime on the micro model (tolerances: parity_spark README)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_tts.audio_tokenizer import reference_clip
from spark_tts.codec.wav2vec2 import normalize_waveform
from tests.spark.conftest import max_abs, needs_parity_data

pytestmark = [pytest.mark.parity, needs_parity_data]


def test_wav2vec2_input_normalisation(reference, dump) -> None:
    assert max_abs(normalize_waveform(torch.from_numpy(reference))[None], dump["at_w2v_input_values"]) < 1e-6


def test_wav2vec2_hidden_states_and_mix(engine, dump) -> None:
    wav = torch.from_numpy(dump["at_w2v_input_values"])
    states = engine.audio_tokenizer.wav2vec2.hidden_states(wav)
    for layer in (11, 14, 16):
        assert max_abs(states[layer], dump[f"at_w2v_hidden_{layer}"]) < 2e-4, layer
    assert max_abs(engine.audio_tokenizer.wav2vec2(wav), dump["at_feat_mix"]) < 2e-4
    # the mix is of layers 11/14/16 exactly: a neighbouring layer is far off
    assert max_abs(states[12], dump["at_w2v_hidden_11"]) > 1e-2


def test_semantic_latent_tokens_and_margin(engine, dump) -> None:
    bicodec = engine.bicodec
    latent = bicodec.semantic_latent(torch.from_numpy(dump["at_feat_mix"]))
    assert max_abs(latent, dump["at_semantic_latent"]) < 5e-5
    scores = bicodec.quantizer.scores(latent)[0]
    top2 = scores.topk(2, dim=-1).values
    assert max_abs((top2[:, 0] - top2[:, 1])[None], dump["at_semantic_margin"]) < 5e-5
    assert np.array_equal(scores.argmax(-1).numpy(), dump["at_semantic_tokens"])


def test_reference_mel(engine, reference, dump) -> None:
    clip = reference_clip(reference, engine.audio_tokenizer.audio.ref_segment_length)
    assert clip.numel() == 96000
    assert max_abs(engine.bicodec.mel(clip[None]), dump["at_ref_mel"]) < 1e-5


def test_global_latent_tokens_and_margin(engine, dump) -> None:
    speaker = engine.bicodec.speaker_encoder
    latent = speaker.latents(torch.from_numpy(dump["at_ref_mel"]))
    assert max_abs(latent, dump["at_global_latent"]) < 2e-5
    bounded = speaker.quantizer.bounded(latent)
    margin = (0.5 - (bounded - bounded.round()).abs()).min(dim=-1).values
    assert max_abs(margin, dump["at_global_margin"]) < 5e-5
    assert np.array_equal(speaker.quantizer.tokenize(latent).numpy(), dump["at_global_tokens"])


def test_tokenize_end_to_end(engine, reference, dump) -> None:
    [tokens] = engine.audio_tokenizer.tokenize([reference])
    assert np.array_equal(tokens.semantic_tokens.numpy(), dump["at_semantic_tokens"])
    assert np.array_equal(tokens.global_tokens.numpy(), dump["at_global_tokens"][0])
