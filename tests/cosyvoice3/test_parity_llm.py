"""LLM parity (parity_cv3): the input layout of the three prompt modes, log-probs after the prefill and after each
teacher-forced token (one causal forward and the static KV cache), length limits, stop ids, the silent filter.
Positions and lengths come from the dump."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speech_lm.decode import BatchedDecoder, required_seq_len
from speech_lm.sampling import RepetitionAwareSampling
from cosyvoice3.errors import CosyVoice3InputError
from cosyvoice3.llm import CosyVoice3LM, LLMPrompt, SilentTokenFilter, sampling_params
from cosyvoice3.loading import load_llm
from tests.cosyvoice3.conftest import max_abs, micro_text_rows, needs_parity_data

pytestmark = [pytest.mark.parity, needs_parity_data]
MODES = ("zs", "instruct", "xl")
LOGP_TOL = 1e-4  # fp32 reference; measured about 5e-6


@pytest.fixture(scope="module")
def lm(micro_model_dir, micro_config) -> CosyVoice3LM:
    return load_llm(micro_model_dir / "llm.pt", micro_config)


def prompt_for(mode: str, dump) -> LLMPrompt:
    """The mode's LLM prompt built from the dump's inputs by the mode rules (not from the stored layout)."""
    if mode == "zs":
        return LLMPrompt.build("zero_shot", micro_text_rows(dump["in_text"]), micro_text_rows(dump["in_zs_prompt_text"]),
                               dump["in_prompt_speech_token"][0].tolist())
    if mode == "instruct":  # prompt speech is given and must be dropped
        return LLMPrompt.build("instruct", micro_text_rows(dump["in_text"]), micro_text_rows(dump["in_instruct_text"]),
                               dump["in_prompt_speech_token"][0].tolist())
    return LLMPrompt.build("cross_lingual", micro_text_rows(dump["in_xl_text"]), (),
                           dump["in_prompt_speech_token"][0].tolist())


@pytest.mark.parametrize("mode", MODES)
@torch.inference_mode()
def test_input_layout(lm: CosyVoice3LM, dump, mode: str) -> None:
    p = prompt_for(mode, dump)
    assert list(p.prompt_text + p.text) == dump[f"llm_{mode}_text_rows"][0].tolist()
    layout = lm.embed_prefix(p)
    assert max_abs(layout, dump[f"llm_{mode}_lm_input"]) == 0.0


@pytest.mark.parametrize("mode", MODES)
@torch.inference_mode()
def test_full_forward_log_probs(lm: CosyVoice3LM, dump, mode: str) -> None:
    prefix = torch.from_numpy(dump[f"llm_{mode}_lm_input"])
    steps = dump[f"llm_{mode}_logp"].shape[0] - 1
    forced = torch.as_tensor(dump["in_teacher_speech_token"][0, :steps], dtype=torch.long)
    hidden = lm.hidden(torch.cat([prefix, lm.embed_speech(forced)[None]], dim=1))[0]
    assert max_abs(hidden, dump[f"llm_{mode}_hidden"]) <= LOGP_TOL
    rows = lm.log_probs(hidden[prefix.shape[1] - 1:])
    assert max_abs(rows, dump[f"llm_{mode}_logp"]) <= LOGP_TOL


@pytest.mark.parametrize("mode", MODES)
@torch.inference_mode()
def test_kv_cache_steps(lm: CosyVoice3LM, dump, mode: str) -> None:
    """Prefill into slot 1 of a 2-slot static cache, then one teacher token per step (slot 0 carries junk)."""
    prefix = torch.from_numpy(dump[f"llm_{mode}_lm_input"])
    length = prefix.shape[1]
    reference = dump[f"llm_{mode}_logp"]
    cache = lm.new_cache(num_slots=2, max_len=length + reference.shape[0])
    rows = [lm(prefix, cache=cache, slots=[1])[0, -1]]
    for i, token in enumerate(dump["in_teacher_speech_token"][0, : reference.shape[0] - 1].tolist()):
        rows.append(lm(lm.embed_speech(torch.tensor([[5], [token]])), torch.tensor([[0], [length + i]]), cache)[1, -1])
    assert max_abs(torch.stack(rows), reference) <= LOGP_TOL


@pytest.mark.parametrize("mode", MODES)
def test_decoder_prefill_and_limits(lm: CosyVoice3LM, micro_config, dump, mode: str) -> None:
    request = prompt_for(mode, dump).request(micro_config.llm, seed=3)
    assert (request.min_tokens, request.max_tokens) == tuple(dump[f"llm_{mode}_min_max_len"].tolist())
    decoder = BatchedDecoder(lm, num_slots=1, max_seq_len=required_seq_len(request))
    slot = decoder.add(request)
    assert max_abs(decoder.logp[slot], dump[f"llm_{mode}_logp"][0]) <= LOGP_TOL


def test_special_and_stop_ids(micro_config, dump) -> None:
    c = micro_config.llm
    assert (c.sos_id, c.eos_id, c.task_id, c.fill_id) == tuple(dump["llm_special_ids"].tolist())
    assert c.stop_ids == tuple(dump["llm_stop_token_ids"].tolist())
    assert c.stop_ids[0] == c.sos_id  # the id the decoder masks below min_len, as the reference does


def decode(lm: CosyVoice3LM, request) -> tuple[list[int], str | None]:
    decoder = BatchedDecoder(lm, num_slots=1, max_seq_len=required_seq_len(request))
    slot, tokens = decoder.add(request), []
    while decoder.active_slots:
        out = decoder.step()[slot]
        if out.token is not None:
            tokens.append(out.token)
    return tokens, out.reason


@pytest.mark.parametrize("favoured,stops_at", [("sos_id", "min"), ("eos_id", "start"), ("fill_id", "start")])
def test_min_len_masks_only_sos(lm: CosyVoice3LM, micro_config, dump, favoured: str, stops_at: str) -> None:
    """With one special id made overwhelmingly likely: sos (the id the reference masks below min_len) ends the
    request exactly at min_len; any other special id ends it at once (the reference does not mask those)."""
    import copy

    biased = copy.deepcopy(lm)
    favoured_id = getattr(micro_config.llm, favoured)

    def log_probs(hidden: torch.Tensor) -> torch.Tensor:
        logits = biased.llm_decoder(hidden).float()
        logits[..., favoured_id] += 1e4
        return torch.log_softmax(logits, dim=-1)

    biased.log_probs = log_probs  # type: ignore[method-assign]
    request = prompt_for("zs", dump).request(micro_config.llm, seed=0)
    min_len = request.min_tokens
    tokens, reason = decode(biased, request)
    assert reason == "stop" and len(tokens) == (min_len if stops_at == "min" else 0)


def test_random_decodes_stay_in_the_speech_vocabulary(lm: CosyVoice3LM, micro_config, dump) -> None:
    for seed in range(3):
        request = prompt_for("zs", dump).request(micro_config.llm, seed=seed)
        tokens, reason = decode(lm, request)
        assert all(0 <= t < micro_config.llm.speech_token_size for t in tokens)
        assert reason == "stop" or len(tokens) == request.max_tokens


def test_fixed_length_requests_never_stop_early(lm: CosyVoice3LM, micro_config, dump) -> None:
    request = prompt_for("xl", dump).request(micro_config.llm, seed=1, max_tokens=40, ignore_eos=True)
    decoder = BatchedDecoder(lm, num_slots=1, max_seq_len=required_seq_len(request))
    slot, count = decoder.add(request), 0
    while decoder.active_slots:
        count += decoder.step()[slot].token is not None
    assert count == 40


def test_text_without_endofprompt_is_refused(lm: CosyVoice3LM, dump) -> None:
    with pytest.raises(CosyVoice3InputError, match="endofprompt"):
        lm.embed_prefix(LLMPrompt.build("cross_lingual", dump["in_text"][0].tolist()))
    with pytest.raises(CosyVoice3InputError, match="outside the text vocabulary"):
        # the raw 151646 is beyond the micro vocabulary
        lm.embed_prefix(LLMPrompt.build("cross_lingual", np.ravel(dump["in_xl_text"]).tolist()))


def test_silent_filter_keeps_at_most_five_in_a_row(micro_config) -> None:
    silent = micro_config.llm.silent_tokens
    stream = [7, *([silent[0]] * 4), *([silent[1]] * 4), 9, *([silent[2]] * 6)]
    kept = list(SilentTokenFilter.for_config(micro_config.llm).filter(stream))
    assert kept == [7, *([silent[0]] * 4), silent[1], 9, *([silent[2]] * 5)]


def test_sampling_follows_the_yaml(micro_config) -> None:
    params = sampling_params(micro_config.llm, seed=4)
    s = micro_config.llm.sampling
    assert (params.top_p, params.top_k, params.win_size, params.tau_r, params.seed) == (
        s.top_p, s.top_k, s.win_size, s.tau_r, 4)
    assert params.params().repetition == RepetitionAwareSampling(s.win_size, s.tau_r)  # RAS on, as released
