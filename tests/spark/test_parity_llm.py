"""Prompt, ids and LLM log-probs parity with the upstream runtime (teacher-forced, micro model), on our Qwen2
body, with and without the static KV cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_tts.prompt import build_prompt
from tests.spark.conftest import max_abs, needs_parity_data

pytestmark = [pytest.mark.parity, needs_parity_data]


def _prompt(dump) -> str:
    return build_prompt(str(dump["in_target_text"]), dump["at_global_tokens"][0], str(dump["in_reference_text"]),
                        dump["at_semantic_tokens"])


def test_prompt_string_and_ids(engine, any_dump) -> None:
    dump = any_dump
    assert _prompt(dump) == str(dump["llm_prompt"])
    assert engine.tokenizer.encode(_prompt(dump)) == dump["llm_input_ids"][0].tolist()
    assert engine.tokenizer.semantic_ids(dump["in_teacher_semantic"][0]) == dump["llm_teacher_ids"][0].tolist()
    vocab = engine.tokenizer.vocab
    assert (vocab.eos_id, vocab.pad_id) == (int(dump["llm_request_end_id"][0, 0]), int(dump["llm_request_pad_id"][0, 0]))


def test_engine_prompt_from_a_voice(engine, reference, any_dump) -> None:
    dump = any_dump
    [voice] = engine.prepare_voices([reference], [str(dump["in_reference_text"])])
    assert engine.prompt_ids(voice, str(dump["in_target_text"])) == dump["llm_input_ids"][0].tolist()


def test_transcript_free_prompt_ends_after_the_global_tokens(engine, dump) -> None:
    prompt = build_prompt("Hi.", dump["at_global_tokens"][0])
    assert prompt.startswith("<|task_tts|><|start_content|>Hi.<|end_content|><|start_global_token|>")
    assert prompt.endswith("<|end_global_token|>") and "semantic" not in prompt


def test_token2wav_parsing(engine, dump) -> None:
    assert engine.tokenizer.semantic_codes(dump["t2w_mixed_ids"][0]) == dump["t2w_semantic_tokens"][0].tolist()


def _sequence(dump) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([dump["llm_input_ids"][0], dump["llm_teacher_ids"][0]]).astype(np.int64))


def test_teacher_forced_hidden_logits_and_log_probs(engine, any_dump) -> None:
    dump = any_dump
    lm, ids = engine.lm, _sequence(dump)
    hidden = lm.hidden(lm.embed_prefix(ids))[0]
    assert max_abs(hidden, dump["llm_hidden"]) < 5e-5
    logits = lm.logits(hidden)
    # the oracle's head rows start at the prompt's last position (the one that predicts the first teacher token)
    head = dump["llm_input_ids"].shape[1] - 1
    assert max_abs(logits[head : head + len(dump["llm_logits_head"])], dump["llm_logits_head"]) < 5e-5
    assert max_abs(logits.logsumexp(-1), dump["llm_logsumexp"]) < 5e-5
    logp_next = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
    assert max_abs(logp_next, dump["llm_logp_next"]) < 5e-5
    assert np.array_equal(logits.argmax(-1).numpy(), dump["llm_argmax"])


def test_kv_cache_prefill_and_decode_steps_match_the_oracle(engine, any_dump) -> None:
    dump = any_dump
    lm, ids = engine.lm, _sequence(dump)
    prompt_len = dump["llm_input_ids"].shape[1]
    cache = lm.new_cache(num_slots=2, max_len=512)
    hidden = lm.hidden(lm.embed_prefix(ids[:prompt_len]), cache=cache, slots=[1])
    rows = [torch.log_softmax(lm.logits(hidden[0, -1]), -1)]
    for step in range(20):  # feed teacher tokens one at a time at their positions, cache row 1
        token = ids[prompt_len + step]
        embeds = lm.embed_speech(torch.stack([token, token]).view(2, 1))
        positions = torch.tensor([[0], [prompt_len + step]])
        hidden = lm.hidden(embeds, positions, cache, kv_len=512)
        rows.append(torch.log_softmax(lm.logits(hidden[1, -1]), -1))
    logp = torch.stack(rows)
    targets = ids[prompt_len : prompt_len + 21]
    got = logp.gather(1, targets[:, None])[:, 0]
    assert max_abs(got, dump["llm_logp_next"][prompt_len - 1 : prompt_len + 20]) < 5e-5
