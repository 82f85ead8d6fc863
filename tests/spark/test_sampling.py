"""Spark's sampler on the runtime's decoder (`speech_lm`): temperature + top-k + top-p, seeds, continuous batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speech_lm.decode import BatchedDecoder, generate_tokens
from spark_tts.llm import SparkSampling, spark_request
from tests.spark.conftest import needs_parity_data

pytestmark = [needs_parity_data]


def _prompt(engine, dump) -> list[int]:
    return dump["llm_input_ids"][0].tolist()


def test_log_probs_are_temperature_then_top_k(engine) -> None:
    hidden = torch.randn(3, engine.lm.config.qwen.hidden_size)
    logp = engine.lm.log_probs(hidden)
    assert (torch.isfinite(logp).sum(-1) == 50).all()
    logits = engine.lm.logits(hidden) / 0.8
    kept = logits.topk(50, dim=-1).indices
    expected = torch.log_softmax(logits.gather(1, kept), dim=-1)
    assert torch.allclose(logp.gather(1, kept), expected, atol=1e-5)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(3), atol=1e-5)


def test_sampling_validation() -> None:
    with pytest.raises(ValueError):
        SparkSampling(temperature=0)
    with pytest.raises(ValueError):
        SparkSampling(top_p=1.5)


def test_request_uses_the_whole_prompt_as_prefix(engine, any_dump) -> None:
    dump = any_dump
    request = spark_request(_prompt(engine, dump), seed=1)
    assert request.prefix_length == dump["llm_input_ids"].shape[1]
    assert request.max_tokens == 512 and request.min_tokens == 0 and request.sampling.repetition is None
    assert (request.sampling.top_k, request.sampling.top_p, request.sampling.seed) == (50, 0.95, 1)
    assert engine.lm.vocabulary.stop_ids == (engine.lm.config.eos_id,)


def test_seeded_generation_is_reproducible_and_stays_in_the_nucleus(engine, dump) -> None:
    sampling = SparkSampling(max_new_tokens=12)
    ids = _prompt(engine, dump)
    first = list(generate_tokens(engine.lm, spark_request(ids, sampling, seed=5)))
    again = list(generate_tokens(engine.lm, spark_request(ids, sampling, seed=5)))
    other = list(generate_tokens(engine.lm, spark_request(ids, sampling, seed=6)))
    assert first == again and first != other
    # replay teacher-forced: every drawn id was among the top-50 of its step
    seq = torch.tensor(ids + first)
    logits = engine.lm.logits(engine.lm.hidden(engine.lm.embed_prefix(seq))[0])
    for step, token in enumerate(first):
        row = logits[len(ids) - 1 + step]
        assert token in row.topk(50).indices.tolist()


def test_requests_batched_together_decode_as_alone(engine, dump) -> None:
    sampling = SparkSampling(max_new_tokens=10)
    ids = _prompt(engine, dump)
    short = ids[:40] + ids[-60:]
    solo = [list(generate_tokens(engine.lm, spark_request(p, sampling, seed=s))) for p, s in ((ids, 1), (short, 2))]
    decoder = BatchedDecoder(engine.lm, num_slots=4, max_seq_len=512)
    slots = decoder.add_many([spark_request(ids, sampling, seed=1), spark_request(short, sampling, seed=2)])
    got = {slot: [] for slot in slots}
    while decoder.active_slots:
        for slot, out in decoder.step().items():
            if out.token is not None:
                got[slot].append(out.token)
    assert [got[s] for s in slots] == solo


def test_synthesize_returns_16k_audio_of_the_generated_length(engine, reference, dump) -> None:
    [voice] = engine.prepare_voices([reference], [str(dump["in_reference_text"])])
    sampling = SparkSampling(max_new_tokens=80)
    codes = list(engine.generate(voice, "Hi.", seed=3, sampling=sampling))
    audio = engine.synthesize(voice, "Hi.", seed=3, sampling=sampling)
    assert audio.dtype == np.float32 and audio.size == 320 * len(codes) and np.abs(audio).max() <= 1.0
    streamed = np.concatenate(list(engine.stream(voice, "Hi.", seed=3, sampling=sampling)))
    assert np.abs(streamed - audio).max() < 1e-4
