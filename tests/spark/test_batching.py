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


#: The batching case's second request: the first samples of the reference buffer (the oracle harness's input;
#: tests/fixtures/parity_spark/README.md). The first request is the dump's whole valid reference.
B_SAMPLES = 14400


@pytest.fixture(scope="module")
def pair(dump):
    buffer = dump["in_reference_wav"][0]
    return buffer[: int(dump["in_reference_wav_len"][0, 0])], buffer[:B_SAMPLES]


def _frames(dump) -> tuple[int, int]:
    """Semantic frames of the longer request and of the shorter one alone, as the oracle recorded them."""
    return len(dump["at_batch_a_semantic_tokens"]), len(dump["at_batch_b_solo_semantic_tokens"])


def test_the_oracle_shows_the_upstream_flaw(dump) -> None:
    solo, batched = dump["at_batch_b_solo_semantic_tokens"], dump["at_batch_b_semantic_tokens"]
    long_frames, short_frames = _frames(dump)
    assert batched.shape == (long_frames,) and short_frames < long_frames  # padded to the longer request
    assert not np.array_equal(batched[:short_frames], solo)


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


def test_batched_features_equal_solo_features(engine, pair, dump) -> None:
    """Not only the tokens: the shorter request's features and latents equal its solo ones to float noise."""
    a, b = pair
    long_frames, short = _frames(dump)
    tokenizer, bicodec = engine.audio_tokenizer, engine.bicodec
    feats, mask, frames = tokenizer.features([a, b])
    solo, _, [n] = tokenizer.features([b])
    assert frames == [long_frames, short] and n == short
    assert max_abs(feats[1, :short], solo[0]) < 1e-4
    latent = bicodec.semantic_latent(feats, mask)
    assert max_abs(latent[1, :, :short], bicodec.semantic_latent(solo)[0]) < 1e-4


def test_without_the_mask_the_short_request_changes(engine, pair, dump) -> None:
    """Control: the same padded batch run without the mask does change the short request (what the mask fixes)."""
    a, b = pair
    _, short = _frames(dump)
    tokenizer, bicodec = engine.audio_tokenizer, engine.bicodec
    feats, mask, _ = tokenizer.features([a, b])
    normed = torch.stack([normalize_waveform(torch.from_numpy(a)),
                          torch.nn.functional.pad(normalize_waveform(torch.from_numpy(b)), (0, a.size - b.size))])
    unmasked = tokenizer.wav2vec2(normed)
    assert max_abs(unmasked[1, :short], feats[1, :short]) > 1e-2
