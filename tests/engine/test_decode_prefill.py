"""Batched prefill (``BatchedDecoder.add_many``): several requests of different lengths in one right-padded forward,
or one at a time right-padded to a prefix-length bucket (``padded_prefill``, what the prefill CUDA graphs capture),
give each request the log-probs, cache entries and tokens it gets when prefilled alone, unpadded."""

from __future__ import annotations

import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from speech_lm.config import Qwen2Config
from speech_lm.decode import BatchedDecoder, DecodeRequest, NoFreeSlotError, required_seq_len

REQUESTS = [
    cosyvoice2_request(text=[3, 4, 5, 6], prompt_text=[7, 8], prompt_speech_tokens=[1, 2, 3] * 5,
                       sampling=CosyVoice2Sampling(seed=1, min_token_text_ratio=1, max_token_text_ratio=6)),
    cosyvoice2_request(text=[9, 10], sampling=CosyVoice2Sampling(seed=2, max_token_text_ratio=8)),
    cosyvoice2_request(text=[11, 12, 13], prompt_speech_tokens=[5, 9, 30, 2, 7, 7],
                       sampling=CosyVoice2Sampling(seed=3, top_k=3, max_token_text_ratio=5)),
]
MAX_SEQ_LEN = max(map(required_seq_len, REQUESTS))


@pytest.fixture(scope="module")
def model() -> CosyVoice2LM:
    torch.manual_seed(0)
    qwen = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=64)
    lm = CosyVoice2LM(LLMConfig(qwen=qwen, speech_token_size=40)).eval()
    with torch.no_grad():
        lm.llm_decoder.weight.mul_(40.0)  # peaky logits: the sampled tokens depend on small logit differences
    return lm


def decode_to_end(decoder: BatchedDecoder, slots: list[int]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {slot: [] for slot in slots}
    while decoder.active_slots:
        for slot, out in decoder.step().items():
            if out.token is not None:
                tokens[slot].append(out.token)
    return tokens


def solo(model: CosyVoice2LM, request: DecodeRequest) -> tuple[BatchedDecoder, int]:
    decoder = BatchedDecoder(model, num_slots=1, max_seq_len=MAX_SEQ_LEN)
    return decoder, decoder.add(request)


#: Prefill buckets of the padded modes: every prefix here pads (to 16 or 32 positions), over the junk that the
#: prefixes before it left in the static buffer; the three requests prefill as one group padded to four rows (the
#: fourth writes to the spare slot), as groups of two and one, or one by one.
PADDED = dict(padded_prefill=True, prefill_buckets=(16, 32))
MODES = pytest.mark.parametrize("mode", [{}, PADDED, dict(PADDED, prefill_rows=(1, 2)),
                                         dict(PADDED, prefill_rows=(1,))],
                                ids=["one-forward", "padded-rows-4", "padded-rows-2-1", "padded-one-by-one"])


@MODES
def test_batched_prefill_matches_solo_prefill(model: CosyVoice2LM, mode: dict) -> None:
    assert len({r.prefix_length for r in REQUESTS}) == len(REQUESTS)  # the padding is really exercised
    assert max(r.prefix_length for r in REQUESTS) <= 32 < MAX_SEQ_LEN
    decoder = BatchedDecoder(model, num_slots=4, max_seq_len=MAX_SEQ_LEN, **mode)
    decoder.add(REQUESTS[0])  # slot 0 busy: the batch goes to slots 1, 2, 3
    busy = [decoder.logp[0].clone(), *(t[0].clone() for t in (*decoder.cache.keys, *decoder.cache.values))]
    slots = decoder.add_many(REQUESTS)
    assert slots == [1, 2, 3]
    # a padding row wrote to the spare slot, not to a request's
    after = [decoder.logp[0], *(t[0] for t in (*decoder.cache.keys, *decoder.cache.values))]
    assert all(torch.equal(a, b) for a, b in zip(busy, after))
    for slot, request in zip(slots, REQUESTS):
        alone, alone_slot = solo(model, request)
        torch.testing.assert_close(decoder.logp[slot], alone.logp[alone_slot], rtol=1e-5, atol=1e-5)
        real = slice(0, request.prefix_length)
        for layer in range(model.config.qwen.num_hidden_layers):
            torch.testing.assert_close(decoder.cache.keys[layer][slot, :, real],
                                       alone.cache.keys[layer][alone_slot, :, real], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(decoder.cache.values[layer][slot, :, real],
                                       alone.cache.values[layer][alone_slot, :, real], rtol=1e-5, atol=1e-5)


@MODES
def test_batched_prefill_decodes_the_same_tokens_as_solo(model: CosyVoice2LM, mode: dict) -> None:
    decoder = BatchedDecoder(model, num_slots=3, max_seq_len=MAX_SEQ_LEN, **mode)
    together = decode_to_end(decoder, decoder.add_many(REQUESTS))
    alone = []
    for request in REQUESTS:
        single, slot = solo(model, request)
        alone.append(decode_to_end(single, [slot])[slot])
    assert list(together.values()) == alone
    assert all(len(tokens) > 3 for tokens in alone)


@pytest.mark.parametrize(("options", "groups"), [
    ({}, [(4, 32)]),  # three requests, one group padded to four rows
    ({"prefill_rows": (1, 2)}, [(2, 32), (1, 16)]),
    ({"prefill_tokens": 32}, [(1, 32), (2, 16)]),  # two rows of 32 positions are over the budget
], ids=["one-group", "rows-2", "token-budget"])
def test_padded_prefill_groups_requests_into_buckets(model: CosyVoice2LM, options: dict, groups: list) -> None:
    """`add_many`'s padded prefill takes the requests in order, as many at a time as one (rows, prefix length)
    bucket holds."""
    by_length = sorted(REQUESTS, key=lambda r: r.prefix_length)
    requests = [by_length[-1], *by_length[:2]]
    lengths = [r.prefix_length for r in requests]
    assert lengths[0] > 16 >= max(lengths[1:])  # the first request pads to 32 positions, the others to 16
    decoder = BatchedDecoder(model, num_slots=4, max_seq_len=MAX_SEQ_LEN, **dict(PADDED, **options))
    shapes, run = [], decoder._prefill_padded
    decoder._prefill_padded = lambda rows, length: shapes.append((rows, length)) or run(rows, length)
    decoder.add_many(requests)
    assert shapes == groups


def test_add_many_is_all_or_nothing(model: CosyVoice2LM) -> None:
    decoder = BatchedDecoder(model, num_slots=2, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(NoFreeSlotError):
        decoder.add_many(REQUESTS)
    too_long = cosyvoice2_request(text=[1] * 10, sampling=CosyVoice2Sampling(max_token_text_ratio=50))
    with pytest.raises(ValueError, match="cache positions"):
        decoder.add_many([REQUESTS[1], too_long])
    assert decoder.free_slots == [0, 1]
    assert decoder.add_many([]) == []
