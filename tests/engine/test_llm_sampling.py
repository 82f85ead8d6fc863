"""Sampling and stop rules of the speech-token decoder (docs/reference/cosyvoice2.md#decoding-and-stop-rules,
#ras-sampling), each on logits where the outcome is certain."""

from __future__ import annotations

import math

import pytest
import torch

from cosyvoice2.llm import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from speech_lm.config import Qwen2Config
from speech_lm.decode import BatchedDecoder, DecodeRequest, NoFreeSlotError, generate_tokens, required_seq_len
from speech_lm.sampling import RepetitionAwareSampling, SamplingParams, make_generator, nucleus_sample, ras_sample

NUM_CLASSES = 6564
EOS, EOS2, FILL = 6561, 6562, 6563


def log_probs(probs: dict[int, float], rest: float = 0.0) -> torch.Tensor:
    """Log-probs with the given entries and ``rest`` probability spread evenly over all other classes."""
    p = torch.full((NUM_CLASSES,), rest / (NUM_CLASSES - len(probs)), dtype=torch.float64)
    for index, value in probs.items():
        p[index] = value
    return p.float().log()


def draws(logp: torch.Tensor, history: list[int], n: int = 200, **params) -> list[int]:
    """CosyVoice2's sampling (RAS on), with ``params`` overriding its values."""
    g = make_generator(0, "cpu")
    return [ras_sample(logp, history, CosyVoice2Sampling(**params).params(), g) for _ in range(n)]


def test_nucleus_keeps_the_entry_that_crosses_top_p() -> None:
    logp = log_probs({10: 0.5, 11: 0.25, 12: 0.2, 13: 0.05})
    g = make_generator(0, "cpu")
    seen = {nucleus_sample(logp, 0.8, 25, g) for _ in range(400)}
    assert seen == {10, 11, 12}


def test_nucleus_keeps_at_most_top_k_entries() -> None:
    uniform = torch.full((NUM_CLASSES,), -math.log(NUM_CLASSES))
    g = make_generator(0, "cpu")
    seen = {nucleus_sample(uniform, 0.8, 25, g) for _ in range(400)}
    assert seen <= set(range(25))  # stable sort: ties keep index order
    assert len(seen) > 15


def test_repetition_in_window_resamples_from_full_distribution() -> None:
    logp = log_probs({5: 0.9}, rest=0.1)
    assert set(draws(logp, history=[1, 2, 3])) == {5}
    repeated = draws(logp, history=[5, 1, 2, 3])
    assert 5 not in repeated  # the repeated id is excluded
    assert len(set(repeated)) > 100  # drawn from all classes, not from the nucleus


def test_repetition_outside_window_is_ignored() -> None:
    logp = log_probs({5: 0.9}, rest=0.1)
    history = [5] + list(range(100, 110))  # the 5 is 11 tokens back, window is 10
    assert set(draws(logp, history)) == {5}
    assert 5 not in draws(logp, history, win_size=20, tau_r=0.05)


def test_repetition_threshold_is_win_size_times_tau_r() -> None:
    logp = log_probs({5: 0.9}, rest=0.1)
    assert set(draws(logp, [5, 1, 2], tau_r=0.2)) == {5}  # needs 2 occurrences
    assert 5 not in draws(logp, [5, 1, 5], tau_r=0.2)


def test_repetition_aware_sampling_is_off_unless_a_request_asks_for_it() -> None:
    logp = log_probs({5: 0.9}, rest=0.1)
    g = make_generator(0, "cpu")
    plain = SamplingParams(top_p=0.8, top_k=25)
    assert plain.repetition is None
    assert {ras_sample(logp, [5, 5, 5], plain, g) for _ in range(200)} == {5}
    assert set(draws(logp, [5, 5, 5], win_size=0)) == {5}  # CosyVoice2's window 0 turns it off as well
    with_ras = SamplingParams(top_p=0.8, top_k=25, repetition=RepetitionAwareSampling(win_size=10, tau_r=0.1))
    assert 5 not in {ras_sample(logp, [5, 5, 5], with_ras, g) for _ in range(200)}
    with pytest.raises(ValueError):
        RepetitionAwareSampling(win_size=0, tau_r=0.1)


def test_no_top_k_keeps_the_whole_vocabulary() -> None:
    uniform = torch.full((NUM_CLASSES,), -math.log(NUM_CLASSES))
    g = make_generator(0, "cpu")
    seen = {ras_sample(uniform, [], SamplingParams(), g) for _ in range(400)}
    assert max(seen) > 1000  # top-k 25 would keep ids 0..24 only


def tiny_model(bias: dict[int, float]) -> CosyVoice2LM:
    """A small random LM whose speech logits are exactly ``llm_decoder.bias`` (zero head weight)."""
    torch.manual_seed(0)
    qwen = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=32, vocab_size=64)
    model = CosyVoice2LM(LLMConfig(qwen=qwen)).eval()
    with torch.no_grad():
        model.llm_decoder.weight.zero_()
        model.llm_decoder.bias.zero_()
        for index, value in bias.items():
            model.llm_decoder.bias[index] = value
    return model


TEXT = [3, 4, 5, 6, 7]  # 5 target tokens: min_len 10, max_len 100


@pytest.mark.parametrize("end_id", [EOS, EOS2, FILL])
def test_every_end_id_stops_and_is_never_emitted(end_id: int) -> None:
    request = cosyvoice2_request(text=TEXT, sampling=CosyVoice2Sampling(seed=1))
    tokens = list(generate_tokens(tiny_model({end_id: 30.0}), request))
    assert all(t < 6561 for t in tokens)
    # Only EOS is masked below the minimum length (upstream's ignore_eos); 6562/6563 stop at once.
    assert len(tokens) == (10 if end_id == EOS else 0)


def test_minimum_length_suppresses_eos_with_prompt_text_not_counted() -> None:
    request = cosyvoice2_request(text=TEXT, prompt_text=[9] * 7, prompt_speech_tokens=[1, 2, 3],
                            sampling=CosyVoice2Sampling(seed=2, min_token_text_ratio=3))
    assert len(list(generate_tokens(tiny_model({EOS: 30.0}), request))) == 15


def test_maximum_length_stops() -> None:
    model = tiny_model({EOS: -1e4, EOS2: -1e4, FILL: -1e4})
    request = cosyvoice2_request(text=TEXT, prompt_text=[1, 2], sampling=CosyVoice2Sampling(seed=3))
    tokens = list(generate_tokens(model, request))
    assert len(tokens) == 100


def test_seed_reproduces_and_different_seeds_differ() -> None:
    model = tiny_model({EOS: -1e4, EOS2: -1e4, FILL: -1e4})  # uniform over speech ids: 25 choices per step

    def run(seed: int) -> list[int]:
        return list(generate_tokens(model, cosyvoice2_request(text=TEXT[:2], sampling=CosyVoice2Sampling(seed=seed))))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_decoder_slot_management() -> None:
    model = tiny_model({EOS: -1e4, EOS2: -1e4, FILL: -1e4})
    request = cosyvoice2_request(text=TEXT[:1], sampling=CosyVoice2Sampling(seed=4))  # max_len 20
    decoder = BatchedDecoder(model, num_slots=2, max_seq_len=required_seq_len(request))
    first, second = decoder.add(request), decoder.add(request)
    assert (first, second) == (0, 1) and decoder.free_slots == []
    with pytest.raises(NoFreeSlotError):
        decoder.add(request)
    decoder.remove(first)
    assert decoder.free_slots == [0]
    outputs = decoder.step()
    assert set(outputs) == {1} and outputs[1].token is not None
    with pytest.raises(ValueError, match="cache positions"):
        decoder.add(cosyvoice2_request(text=TEXT[:2]))  # needs 4 + 40 > 23 positions
    with pytest.raises(ValueError):
        DecodeRequest((1, 2), SamplingParams(), max_tokens=-1)


def test_decoder_reports_length_finish_with_the_last_token() -> None:
    model = tiny_model({EOS: -1e4, EOS2: -1e4, FILL: -1e4})
    request = cosyvoice2_request(text=TEXT[:1], sampling=CosyVoice2Sampling(seed=5))
    decoder = BatchedDecoder(model, num_slots=1, max_seq_len=required_seq_len(request))
    slot = decoder.add(request)
    outputs = [decoder.step()[slot] for _ in range(20)]
    assert all(o.token is not None for o in outputs)
    assert [o.finished for o in outputs] == [False] * 19 + [True]
    assert outputs[-1].reason == "length" and decoder.active_slots == []


# ---- explicit per-request limits ----------------------------------------------------------------------------------
def test_explicit_limits_replace_the_text_ratios() -> None:
    eos_first = tiny_model({EOS: 30.0})
    request = cosyvoice2_request(text=TEXT, sampling=CosyVoice2Sampling(seed=6, min_tokens=4, max_tokens=50))
    assert len(list(generate_tokens(eos_first, request))) == 4  # EOS masked for 4 tokens only (ratio: 10)
    never_ending = tiny_model({EOS: -1e4, EOS2: -1e4, FILL: -1e4})
    request = cosyvoice2_request(text=TEXT, sampling=CosyVoice2Sampling(seed=6, max_tokens=7))
    assert len(list(generate_tokens(never_ending, request))) == 7  # ratio: 100
    with pytest.raises(ValueError):
        CosyVoice2Sampling(max_tokens=-1)


@pytest.mark.parametrize("end_id", [EOS, EOS2, FILL])
def test_ignore_eos_runs_to_max_tokens_without_touching_other_requests(end_id: int) -> None:
    model = tiny_model({end_id: 30.0})
    ignoring = cosyvoice2_request(text=TEXT, sampling=CosyVoice2Sampling(seed=7, max_tokens=12, ignore_eos=True))
    normal = cosyvoice2_request(text=TEXT, sampling=CosyVoice2Sampling(seed=8, max_tokens=12))
    decoder = BatchedDecoder(model, num_slots=2, max_seq_len=required_seq_len(normal))
    slots = decoder.add_many([ignoring, normal])
    tokens: dict[int, list[int]] = {slot: [] for slot in slots}
    while decoder.active_slots:
        for slot, out in decoder.step().items():
            if out.token is not None:
                tokens[slot].append(out.token)
    assert len(tokens[slots[0]]) == 12 and all(t < EOS for t in tokens[slots[0]])
    assert len(tokens[slots[1]]) == (10 if end_id == EOS else 0)  # the neighbour keeps the upstream rules


def test_the_decoding_defaults_are_written_once_and_are_cosyvoice2s() -> None:
    import numpy as np

    from cosyvoice2.llm import sampling_defaults as defaults
    from speech_serving.orchestrator import SamplingConfig
    from triton_repo import internal_io as io

    # the reference's values (docs/reference/cosyvoice2.md#ras-sampling)
    assert (defaults.TOP_K, defaults.TOP_P, defaults.TEMPERATURE, defaults.WIN_SIZE, defaults.TAU_R) == (25, 0.8, 1.0, 10, 0.1)
    engine, orchestrator = CosyVoice2Sampling(), SamplingConfig()
    decoder = engine.params()
    assert (decoder.top_k, decoder.top_p, decoder.repetition) == (25, 0.8, RepetitionAwareSampling(10, 0.1))
    assert (engine.top_k, engine.top_p, engine.win_size, engine.tau_r) == (25, 0.8, 10, 0.1)
    assert (orchestrator.top_k, orchestrator.top_p, orchestrator.temperature) == (25, 0.8, 1.0)
    assert (engine.min_token_text_ratio, engine.max_token_text_ratio) == (
        orchestrator.min_token_text_ratio, orchestrator.max_token_text_ratio) == (2.0, 20.0)
    # an LLM request without sampling tensors decodes with them
    request, _ = io.parse_llm_request({io.INPUT_IDS.name: np.array([[1, 2, 3]], np.int32)})
    assert (request.top_k, request.top_p, request.temperature) == (25, 0.8, 1.0)
