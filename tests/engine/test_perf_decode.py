"""The graph-ready decode step (batched on-device RAS sampling, batch buckets, CUDA graphs) against plain
row-by-row decoding. CPU tests cover the step the graphs capture; tests/gpu/test_llm_graphs.py compares
replays to eager on CUDA."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from speech_lm.config import Qwen2Config
from speech_lm.decode import BatchedDecoder, DecodeRequest, required_seq_len
from speech_lm.sampling import draw_uniforms, make_generator, ras_draw


# ---- the vectorised sampler against a naive per-row reference --------------------------------------------------
def naive_ras(probs: list[float], u: tuple[float, float], history: list[int], top_p: float, top_k: int,
              win: int, tau: float) -> int:
    """RAS as docs/reference/cosyvoice2.md#ras-sampling words it, in float64 Python: nucleus inverse-CDF draw, then
    the repetition fallback."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])  # Python's sort is stable
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if mass >= top_p or rank >= top_k:
            break
        kept.append(i)
        mass += probs[i]

    def inverse_cdf(ids: list[int], weights: list[float], uniform: float) -> int:
        target, acc = uniform * sum(weights), 0.0
        for i, w in zip(ids, weights):
            acc += w
            if acc > target:
                return i
        return ids[-1]

    token = inverse_cdf(kept, [probs[i] for i in kept], u[0])
    if win > 0 and history[-win:].count(token) >= win * tau:
        ids = list(range(len(probs)))
        token = inverse_cdf(ids, [0.0 if i == token else p for i, p in enumerate(probs)], u[1])
    return token


def test_ras_draw_matches_naive_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, classes, hist_len = 24, 300, 16
    logits = torch.randn(rows, classes, generator=gen) * torch.linspace(0.5, 6.0, rows).unsqueeze(1)
    logp = logits.log_softmax(-1)
    uniforms = torch.rand(rows, 2, generator=gen)
    top = logp.argmax(-1)
    history = torch.randint(0, classes, (rows, hist_len), generator=gen)
    history[::2, -3:] = top[::2, None]  # every other row: its likely id repeats in the window
    lengths = torch.randint(0, hist_len + 1, (rows,), generator=gen)
    rng = random.Random(1)
    top_p = [rng.choice([0.3, 0.8, 0.95]) for _ in range(rows)]
    top_k = [rng.choice([1, 5, 25]) for _ in range(rows)]
    win = [rng.choice([0, 4, 10]) for _ in range(rows)]
    tau = [rng.choice([0.1, 0.3]) for _ in range(rows)]

    got = ras_draw(logp, uniforms, history, lengths, torch.tensor(top_p), torch.tensor(top_k), torch.tensor(win),
                   torch.tensor([w * t for w, t in zip(win, tau)])).tolist()

    probs = logp.double().softmax(-1).tolist()
    expected = [naive_ras(probs[b], tuple(uniforms[b].tolist()), history[b, : lengths[b]].tolist(), top_p[b],
                          top_k[b], win[b], tau[b]) for b in range(rows)]
    assert got == expected
    assert len(set(got)) > rows // 2  # the rows really differ


# ---- the batched decoder against one request at a time -----------------------------------------------------------
def small_model(seed: int = 0) -> CosyVoice2LM:
    torch.manual_seed(seed)
    qwen = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=64)
    model = CosyVoice2LM(LLMConfig(qwen=qwen, speech_token_size=40)).eval()
    with torch.no_grad():
        model.llm_decoder.weight.mul_(40.0)  # peaky logits: repetitions, nucleus cut-offs and early stops happen
    return model


@torch.inference_mode()
def decode_row_by_row(model: CosyVoice2LM, request: DecodeRequest) -> list[int]:
    """One request alone, no slots or buckets: prefill, then per step mask/sample/stop and a batch-1 forward."""
    cfg = model.config
    min_len, max_len = (request.min_tokens, request.max_tokens)
    uniforms = draw_uniforms(max_len, make_generator(request.sampling.seed, "cpu"))
    cache = model.new_cache(1, required_seq_len(request))
    prefix = model.embed_prefix(request.prefix)
    logp = model(prefix, cache=cache, slots=[0])[0, -1]
    p, tokens = request.sampling, []
    ras = p.repetition  # every request below samples with RAS
    while len(tokens) < max_len:
        row = logp.clone()
        if len(tokens) < min_len:
            row[cfg.eos_id] = -math.inf
        token = int(ras_draw(row[None], uniforms[len(tokens)][None], torch.tensor([tokens or [0]]),
                             torch.tensor([len(tokens)]), torch.tensor([p.top_p]), torch.tensor([p.top_k]),
                             torch.tensor([ras.win_size]), torch.tensor([ras.win_size * ras.tau_r])))
        if token in cfg.stop_ids:
            break
        tokens.append(token)
        position = torch.tensor([[request.prefix_length + len(tokens) - 1]])
        logp = model(model.embed_speech(torch.tensor([[token]])), position, cache)[0, -1]
    return tokens


REQUESTS = [
    cosyvoice2_request(text=[3, 4, 5, 6], prompt_text=[7, 8], prompt_speech_tokens=[1, 2, 3],
                       sampling=CosyVoice2Sampling(seed=11, min_token_text_ratio=1)),
    cosyvoice2_request(text=[9, 10], sampling=CosyVoice2Sampling(seed=12, top_k=3, win_size=4, tau_r=0.5)),
    cosyvoice2_request(text=[11, 12, 13], prompt_speech_tokens=[5] * 6,
                       sampling=CosyVoice2Sampling(seed=13, top_p=0.5, min_token_text_ratio=0)),
    cosyvoice2_request(text=[14, 15, 16, 17, 18], sampling=CosyVoice2Sampling(seed=14, max_token_text_ratio=3)),
]


@torch.inference_mode()
def decode_batched(model: CosyVoice2LM, buckets: tuple[int, ...], join_at: list[int],
                   prefill_buckets: tuple[int, ...] | None = None) -> list[list[int]]:
    """Requests join at the given steps (continuous batching); returns each request's tokens. With buckets, the
    length buckets make attention read 16, 24, 32 or all cache positions as the sequences grow. With
    `prefill_buckets`, each request prefills alone, right-padded to one of them (what the prefill graphs capture),
    or in the eager batched pass where its prefix is longer than all of them."""
    decoder = BatchedDecoder(model, num_slots=4, max_seq_len=max(map(required_seq_len, REQUESTS)),
                             cuda_graphs=False, batch_buckets=buckets, length_buckets=(16, 24, 32) if buckets else (),
                             prefill_buckets=prefill_buckets or (), padded_prefill=prefill_buckets is not None)
    owner: dict[int, int] = {}
    tokens: list[list[int]] = [[] for _ in REQUESTS]
    step, pending = 0, list(range(len(REQUESTS)))
    while pending or decoder.active_slots:
        while pending and join_at[pending[0]] <= step and decoder.free_slots:
            index = pending.pop(0)
            owner[decoder.add(REQUESTS[index])] = index
        for slot, out in decoder.step().items():
            if out.token is not None:
                tokens[owner[slot]].append(out.token)
        step += 1
    return tokens


@pytest.mark.parametrize("prefill_buckets", [None, (8, 16), (4, 8)], ids=["batched-prefill", "padded-prefill",
                                                                         "padded-or-eager-prefill"])
@pytest.mark.parametrize("buckets", [(1, 2, 4), ()], ids=["buckets", "full-width"])
def test_batched_decoder_matches_row_by_row_decoding(buckets: tuple[int, ...], prefill_buckets) -> None:
    """(4, 8): the prefixes of 4 and 7 positions pad to a bucket, those of 11 (longer than every bucket) take the
    eager pass; (8, 16): every prefix pads, over junk that earlier prefixes left in the static buffer."""
    model = small_model()
    expected = [decode_row_by_row(model, r) for r in REQUESTS]
    assert len({len(t) for t in expected}) > 1 and any(len(t) > 5 for t in expected)
    # request 1 joins at step 3 (slot 1, two rows), 2 and 3 later: the bucket grows from 1 to 2 to 4 rows
    got = decode_batched(model, buckets, join_at=[0, 3, 4, 9], prefill_buckets=prefill_buckets)
    assert got == expected

