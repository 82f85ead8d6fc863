"""The Spark internal tensors: which requests `spark_engine` accepts, and the conversions on both sides."""

from __future__ import annotations

import numpy as np
import pytest

from speech_serving.errors import InvalidInput
from speech_serving.io_struct import SparkLLMRequest, SparkVoicePrompt
from triton_repo import spark_io as io


def test_engine_requests_are_an_llm_request_a_stop_or_a_vocoder_request():
    assert io.engine_request_kind(["input_ids", "request_output_len", "random_seed"]) == io.LLM_KIND
    assert io.engine_request_kind(["stop"]) == io.LLM_KIND
    assert io.engine_request_kind(["global_tokens", "semantic_tokens", "emit"]) == io.VOCODER_KIND
    for names in ([], ["global_tokens", "semantic_tokens"], ["input_ids", "emit"], ["request_output_len"]):
        with pytest.raises(InvalidInput):
            io.engine_request_kind(names)


def test_llm_requests_round_trip():
    request = SparkLLMRequest(np.array([5, 6, 7], np.int32), 40, 2**63 + 5, (12, 30))
    parsed, stop = io.parse_llm_request(io.llm_request_tensors(request))
    assert not stop and parsed.max_new_tokens == 40 and parsed.seed == 2**63 + 5 and parsed.deliver_at == (12, 30)
    np.testing.assert_array_equal(parsed.prompt_ids, request.prompt_ids)
    offline, _ = io.parse_llm_request(io.llm_request_tensors(SparkLLMRequest(np.array([1], np.int32), 3, 1, ())))
    assert offline.deliver_at == ()  # only at the end
    assert io.parse_llm_request(io.llm_stop_tensors()) == (None, True)
    with pytest.raises(InvalidInput):
        io.parse_llm_request({io.PROMPT_IDS.name: np.array([1], np.int32), io.MAX_NEW_TOKENS.name: np.array([0])})


def test_vocoder_and_voice_tensors_round_trip():
    g, s = np.arange(32, dtype=np.int32), np.array([3, 1, 4, 1, 5], np.int32)
    parsed = io.parse_vocode_request(io.vocode_tensors(g, s, 1, 4))
    assert parsed[2:] == (1, 4) and (parsed[0] == g).all() and (parsed[1] == s).all()
    voice = io.voice_from_tensors({k: v[None] for k, v in io.voice_to_tensors(SparkVoicePrompt(g, s)).items()})
    assert (voice.global_tokens == g).all() and (voice.semantic_tokens == s).all()
