"""The LLM request the orchestrator computed becomes the engine's `DecodeRequest` with exactly its limits."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.engines import build_decode_request
from speech_serving.errors import InvalidInput

VOCAB = SpeechVocabLayout(text_vocab_size=1000, speech_token_size=50)


def _ids(text: list[int], speech: list[int]) -> np.ndarray:
    return np.array([VOCAB.sos_id, *text, VOCAB.task_id_id, *VOCAB.to_vocab_ids(np.array(speech))], np.int32)


@pytest.mark.parametrize("n_text", [1, 3, 7, 113, 300])
@pytest.mark.parametrize("limits", [(0, 1), (0, 37), (2, 2), (14, 140), (600, 3796), (1, 4095)])
def test_the_decoder_gets_exactly_the_requested_token_limits(n_text, limits):
    min_tokens, max_tokens = limits
    request = build_decode_request(_ids(list(range(n_text)), [4, 0, 49]), VOCAB, min_tokens, max_tokens, 5, 25, 0.8)
    assert (request.min_tokens, request.max_tokens) == (min_tokens, max_tokens)
    # the same numbers the decoder derived before from ratios (count + 0.5) / text tokens
    ratio_min = int(n_text * ((min_tokens + 0.5) / n_text)) if min_tokens else 0
    assert (ratio_min, int(n_text * ((max_tokens + 0.5) / n_text))) == (min_tokens, max_tokens)
    assert list(request.prefix.text) == list(range(n_text)) and list(request.prefix.prompt_speech_tokens) == [4, 0, 49]
    assert (request.sampling.seed, request.sampling.top_k, request.sampling.top_p) == (5, 25, 0.8)
    assert request.sampling.repetition is not None  # CosyVoice2 samples with RAS


@pytest.mark.parametrize(
    "ids, limits, message",
    [
        (_ids([1, 2], [3]), (5, 4), "token limits"),
        (_ids([1, 2], [3]), (0, 0), "token limits"),
        (_ids([1, 2], [50]), (0, 9), "speech token ids"),
        (_ids([], [3]), (0, 9), "text part"),
        (_ids([1, 2], [3])[1:], (0, 9), "sos"),
    ],
)
def test_malformed_llm_requests_are_invalid_input(ids, limits, message):
    with pytest.raises(InvalidInput, match=message):
        build_decode_request(ids, VOCAB, *limits, None, 25, 0.8)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (25, 0.0), (25, 1.5)])
def test_impossible_sampling_settings_are_invalid_input(top_k, top_p):
    with pytest.raises(InvalidInput, match="sampling"):
        build_decode_request(_ids([1, 2], [3]), VOCAB, 0, 9, None, top_k, top_p)
