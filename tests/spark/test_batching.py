"""The audio tokenizer batches requests of different lengths without changing any of them (upstream's runtime
pads without a mask, so a shorter request's semantic tokens change when it shares a batch: the oracle records
that flaw, and we must not reproduce it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_tts.codec.wav2vec2 import normalize_waveform
from tests.spark.conftest import max_abs, needs_parity_data

pytestmark = [needs_parity_data]


@pytest.fixture(scope="module")
def pair(dump):
    buffer = dump["in_reference_wav"][0]
    return buffer[:21920], buffer[:14400]


def test_the_oracle_shows_the_upstream_flaw(dump) -> None:
    solo, batched = dump["at_batch_b_solo_semantic_tokens"], dump["at_batch_b_semantic_tokens"]
    assert (solo.shape, batched.shape) == ((44,), (68,))
    assert not np.array_equal(batched[:44], solo)


def test_batched_requests_get_their_solo_tokens(engine, pair, dump) -> None:
    a, b = pair
    batch = engine.audio_tokenizer.tokenize([a, b])
    assert np.array_equal(batch[0].semantic_tokens.numpy(), dump["at_batch_a_semantic_tokens"])
    assert np.array_equal(batch[1].semantic_tokens.numpy(), dump["at_batch_b_solo_semantic_tokens"])
    assert np.array_equal(batch[0].global_tokens.numpy(), dump["at_batch_a_global_tokens"][0])
    assert np.array_equal(batch[1].global_tokens.numpy(), dump["at_batch_b_solo_global_tokens"][0])
    # order in the batch does not matter either
    swapped = engine.audio_tokenizer.tokenize([b, a])
    assert np.array_equal(swapped[0].semantic_tokens.numpy(), dump["at_batch_b_solo_semantic_tokens"])


def test_batched_features_equal_solo_features(engine, pair) -> None:
    """Not only the tokens: the shorter request's features and latents equal its solo ones to float noise."""
    a, b = pair
    tokenizer, bicodec = engine.audio_tokenizer, engine.bicodec
    feats, mask, frames = tokenizer.features([a, b])
    solo, _, [n] = tokenizer.features([b])
    assert frames == [68, 44] and n == 44
    assert max_abs(feats[1, :44], solo[0]) < 1e-4
    latent = bicodec.semantic_latent(feats, mask)
    assert max_abs(latent[1, :, :44], bicodec.semantic_latent(solo)[0]) < 1e-4


def test_without_the_mask_the_short_request_changes(engine, pair) -> None:
    """Control: the same padded batch run without the mask does change the short request (what the mask fixes)."""
    a, b = pair
    tokenizer, bicodec = engine.audio_tokenizer, engine.bicodec
    feats, mask, _ = tokenizer.features([a, b])
    normed = torch.stack([normalize_waveform(torch.from_numpy(a)),
                          torch.nn.functional.pad(normalize_waveform(torch.from_numpy(b)), (0, a.size - b.size))])
    unmasked = tokenizer.wav2vec2(normed)
    assert max_abs(unmasked[1, :44], feats[1, :44]) > 1e-2
