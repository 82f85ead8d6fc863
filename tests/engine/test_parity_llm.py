"""LLM parity against the upstream reference outputs on the micro model (parity/README.md), plus batched decoding
equivalence: requests decoded together in slots see the same log-probs as each decoded alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from speech_lm.decode import BatchedDecoder, DecodeRequest, required_seq_len
from tests.conftest import FIXTURES_DIR

PARITY_DIR = FIXTURES_DIR / "parity"
pytestmark = [
    pytest.mark.parity,
    pytest.mark.skipif(not (PARITY_DIR / "micro" / "llm.pt").exists(), reason="parity data absent"),
]


@pytest.fixture(scope="module")
def dump() -> dict[str, np.ndarray]:
    with np.load(PARITY_DIR / "micro_dump_seed1234.npz") as arrays:
        return {k: arrays[k] for k in arrays.files if k.startswith(("llm_", "in_"))}


@pytest.fixture(scope="module")
def model() -> CosyVoice2LM:
    harness = json.loads((PARITY_DIR / "micro" / "harness_config.json").read_text())
    lm = CosyVoice2LM(LLMConfig.from_harness(harness["llm"]))
    lm.load_state_dict(torch.load(PARITY_DIR / "micro" / "llm.pt", weights_only=True), strict=True)
    return lm.eval()


@pytest.fixture(scope="module")
def request_from_dump(dump: dict[str, np.ndarray]) -> DecodeRequest:
    return cosyvoice2_request(
        text=dump["in_text"][0].tolist(),
        prompt_text=dump["in_prompt_text"][0].tolist(),
        prompt_speech_tokens=dump["in_prompt_speech_token"][0].tolist(),
        sampling=CosyVoice2Sampling(seed=11),
    )


def max_abs(ours: torch.Tensor, reference: np.ndarray) -> float:
    assert tuple(ours.shape) == reference.shape
    return float(np.abs(ours.detach().numpy() - reference).max())


def test_lm_head_is_tied_to_embed_tokens(model: CosyVoice2LM) -> None:
    assert model.llm.model.lm_head.weight is model.body.embed_tokens.weight


@torch.inference_mode()
def test_input_assembly_is_exact(model: CosyVoice2LM, request_from_dump: DecodeRequest, dump) -> None:
    r = request_from_dump
    lm_input = model.embed_prefix(r.prefix)
    assert max_abs(lm_input, dump["llm_lm_input"]) == 0.0


@torch.inference_mode()
def test_full_causal_forward(model: CosyVoice2LM, dump) -> None:
    teacher = torch.as_tensor(dump["in_teacher_speech_token"][0], dtype=torch.long)
    sequence = torch.cat([torch.from_numpy(dump["llm_lm_input"]), model.embed_speech(teacher)[None]], dim=1)
    hidden = model.hidden(sequence)
    assert max_abs(hidden[0], dump["llm_hidden_full"]) <= 2e-5
    assert max_abs(model.log_probs(hidden)[0], dump["llm_logp_full"]) <= 5e-5


@torch.inference_mode()
def test_static_kv_cache_steps(model: CosyVoice2LM, dump) -> None:
    """Prefill into slot 1 of a 2-slot cache, then one teacher token per step over both slots."""
    prefix = torch.from_numpy(dump["llm_lm_input"])
    prefix_len = prefix.shape[1]
    cache = model.new_cache(num_slots=2, max_len=prefix_len + dump["in_teacher_speech_token"].shape[1])
    rows = [model(prefix, cache=cache, slots=[1])[0, -1]]
    for i, token in enumerate(dump["in_teacher_speech_token"][0].tolist()):
        embeds = model.embed_speech(torch.tensor([[7], [token]]))
        positions = torch.tensor([[3], [prefix_len + i]])
        rows.append(model(embeds, positions, cache)[1, -1])
    assert max_abs(torch.stack(rows), dump["llm_logp_step"]) <= 5e-5


def test_length_limits(dump) -> None:
    min_len, max_len = CosyVoice2Sampling().token_limits(dump["in_text"].shape[1])
    assert (min_len, max_len) == (int(dump["llm_min_len"]), int(dump["llm_max_len"]))


@torch.inference_mode()
def test_decoder_prefill_matches_reference(model: CosyVoice2LM, request_from_dump: DecodeRequest, dump) -> None:
    decoder = BatchedDecoder(model, num_slots=2, max_seq_len=required_seq_len(request_from_dump))
    slot = decoder.add(request_from_dump)
    assert max_abs(decoder.logp[slot], dump["llm_logp_step"][0]) <= 5e-5


def decode_alone(model: CosyVoice2LM, request: DecodeRequest) -> tuple[list[torch.Tensor], list[int]]:
    decoder = BatchedDecoder(model, num_slots=1, max_seq_len=required_seq_len(request))
    slot = decoder.add(request)
    logps, tokens = [], []
    while decoder.active_slots:
        logps.append(decoder.logp[slot].clone())
        out = decoder.step()[slot]
        if out.token is not None:
            tokens.append(out.token)
    return logps, tokens


def test_batched_slots_match_solo_decoding(model: CosyVoice2LM, request_from_dump: DecodeRequest) -> None:
    """Three requests through two slots: B joins after A's 5th step, C reuses the first slot that frees up."""
    a = request_from_dump
    p = a.prefix
    b = cosyvoice2_request(text=p.text[:5], prompt_text=p.prompt_text[2:],
                           prompt_speech_tokens=p.prompt_speech_tokens[:17], sampling=CosyVoice2Sampling(seed=12))
    c = cosyvoice2_request(text=p.text[3:9], sampling=CosyVoice2Sampling(seed=13))
    solo = {name: decode_alone(model, r) for name, r in {"a": a, "b": b, "c": c}.items()}

    decoder = BatchedDecoder(model, num_slots=2, max_seq_len=max(required_seq_len(r) for r in (a, b, c)))
    logps: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    owner = {decoder.add(a): "a"}
    pending = ["b", "c"]
    steps = 0
    while decoder.active_slots or pending:
        if pending and decoder.free_slots and (pending[0] != "b" or steps >= 5):
            name = pending.pop(0)
            owner[decoder.add({"b": b, "c": c}[name])] = name
        active = {slot: owner[slot] for slot in decoder.active_slots}
        for slot, name in active.items():
            logps[name].append(decoder.logp[slot].clone())
        for slot, out in decoder.step().items():
            if out.token is not None:
                tokens[active[slot]].append(out.token)
        steps += 1

    for name, (solo_logps, solo_tokens) in solo.items():
        assert tokens[name] == solo_tokens, name
        assert len(solo_tokens) > 0
        diff = (torch.stack(logps[name]) - torch.stack(solo_logps)).abs()
        finite = torch.isfinite(torch.stack(solo_logps))
        assert float(diff[finite].max()) <= 5e-5, name
