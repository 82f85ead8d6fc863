"""CosyVoice3 text tokenizer: special-token ids and the three prompt formats' layout, compared with the layout
of the oracle's LLM text inputs (where `<|endofprompt|>` sits, what precedes and follows it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speech_lm.testing import write_test_tokenizer
from cosyvoice2.text.tokenizer import ADDITIONAL_SPECIAL_TOKENS as COSYVOICE2_SPECIALS
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from cosyvoice3.config import ENDOFPROMPT_ID, SYSTEM_PROMPT, CosyVoice3LLMConfig
from cosyvoice3.errors import CosyVoice3InputError
from cosyvoice3.text import (ENDOFSYSTEM, SPECIAL_TOKENS, CosyVoice3Tokenizer, cmu_phone_tokens, pinyin_tokens,
                             prompt_ids, request_mode, toned_final)
from tests.cosyvoice3.conftest import needs_parity_data

QWEN_BASE_VOCAB = 151643  # regular BPE entries of the released CosyVoice-BlankEN; <|endoftext|> is the next id


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> CosyVoice3Tokenizer:
    model_dir = tmp_path_factory.mktemp("cv3_model")
    write_test_tokenizer(model_dir / "CosyVoice-BlankEN", base_vocab_size=QWEN_BASE_VOCAB)
    return CosyVoice3Tokenizer.from_model_dir(model_dir)


def test_cosyvoice2_ids_are_kept_and_every_special_fits_the_text_embedding(tokenizer: CosyVoice3Tokenizer) -> None:
    assert tokenizer.token_id("<|endoftext|>") == QWEN_BASE_VOCAB
    assert tokenizer.token_id("<|endofprompt|>") == ENDOFPROMPT_ID == CosyVoice3LLMConfig().endofprompt_id
    # CosyVoice2's list comes first, so its tokens keep CosyVoice2's ids (<|im_start|>/<|im_end|> are base tokens)
    first_new = QWEN_BASE_VOCAB + 3
    for offset, token in enumerate(COSYVOICE2_SPECIALS[2:]):
        assert tokenizer.token_id(token) == first_new + offset, token
    assert tokenizer.token_id(ENDOFSYSTEM) == first_new + len(COSYVOICE2_SPECIALS) - 2
    ids = [tokenizer.token_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert len(tokenizer) == QWEN_BASE_VOCAB + 1 + len(SPECIAL_TOKENS)  # <|endoftext|> + the specials
    assert max(ids) < CosyVoice3LLMConfig().qwen.vocab_size


def test_phone_and_pinyin_tokens_follow_their_rules() -> None:
    phones = cmu_phone_tokens()
    assert len(phones) == 15 * 3 + 24 and phones[:3] == ("[AA0]", "[AA1]", "[AA2]") and "[B]" in phones
    assert "[AA]" not in phones and "[B0]" not in phones
    assert toned_final("a", 1) == "ā" and toned_final("iao", 3) == "iǎo" and toned_final("iu", 2) == "iú"
    assert toned_final("ui", 4) == "uì" and toned_final("ou", 3) == "ǒu" and toned_final("ve", 4) == "üè"
    assert toned_final("ang", 5) == "ang"
    pinyin = pinyin_tokens()
    assert {"[j]", "[ǐ]", "[zh]", "[ǚ]", "[ün]"} <= set(pinyin)
    with pytest.raises(ValueError):
        toned_final("a", 0)


def test_marks_phones_and_pinyin_encode_as_single_ids(tokenizer: CosyVoice3Tokenizer) -> None:
    text = "[breath]Hello[laughter] [j][ǐ]<|endofsystem|>[HH][AH0]"
    ids = tokenizer.encode(text)
    for token in ("[breath]", "[laughter]", "[j]", "[ǐ]", ENDOFSYSTEM, "[HH]", "[AH0]"):
        assert tokenizer.token_id(token) in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "Hello "


def test_cosyvoice2_tokenizer_is_unchanged(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path, base_vocab_size=QWEN_BASE_VOCAB)
    cv2 = CosyVoice2Tokenizer(tmp_path)
    assert len(cv2) == QWEN_BASE_VOCAB + 1 + len(COSYVOICE2_SPECIALS)
    with pytest.raises(KeyError):
        cv2.token_id(ENDOFSYSTEM)


def _split_at_endofprompt(ids) -> tuple[list[int], list[int]]:
    ids = [int(i) for i in np.ravel(ids)]
    assert ids.count(ENDOFPROMPT_ID) == 1, ids
    at = ids.index(ENDOFPROMPT_ID)
    return ids[:at], ids[at + 1:]


@needs_parity_data
def test_prompt_formats_have_the_oracle_layout(tokenizer: CosyVoice3Tokenizer, dump) -> None:
    """The oracle's text ids are random stand-ins, so what is compared is their structure: zero-shot prompt and
    cross-lingual text share the system-prompt prefix before `<|endofprompt|>`; after it come the transcript
    (zero-shot) or the whole target text (cross-lingual, equal to the other modes' text); the instruct prompt ends
    with `<|endofprompt|>`; the other modes' texts hold none."""
    target, transcript, instruction = "Hello world", "hello there", "Please speak slowly."
    system = tokenizer.encode(SYSTEM_PROMPT)

    oracle_zs_head, oracle_zs_tail = _split_at_endofprompt(dump["in_zs_prompt_text"])
    oracle_xl_head, oracle_xl_tail = _split_at_endofprompt(dump["in_xl_text"])
    oracle_in_head, oracle_in_tail = _split_at_endofprompt(dump["in_instruct_text"])
    assert oracle_zs_head == oracle_xl_head and oracle_xl_tail == [int(i) for i in np.ravel(dump["in_text"])]
    assert oracle_in_tail == [] and ENDOFPROMPT_ID not in np.ravel(dump["in_text"])

    text, prompt = prompt_ids(tokenizer, "zero_shot", target, reference_text=transcript)
    head, tail = _split_at_endofprompt(prompt)
    assert head == system and tail == tokenizer.encode(transcript) and text == tokenizer.encode(target)
    assert ENDOFPROMPT_ID not in text

    xl_text, xl_prompt = prompt_ids(tokenizer, "cross_lingual", target)
    xl_head, xl_tail = _split_at_endofprompt(xl_text)
    assert xl_prompt == [] and xl_head == head and xl_tail == text

    in_text, in_prompt = prompt_ids(tokenizer, "instruct", target, instruction=instruction)
    in_head, in_tail = _split_at_endofprompt(in_prompt)
    assert in_tail == [] and in_head == tokenizer.encode(f"{SYSTEM_PROMPT} {instruction}")
    assert in_head[:len(system)] == system and in_text == text


def test_mode_selection_and_missing_fields(tokenizer: CosyVoice3Tokenizer) -> None:
    assert request_mode("hi", None) == "zero_shot"
    assert request_mode(None, "speak fast") == "instruct"
    assert request_mode(None, None) == "cross_lingual"
    with pytest.raises(CosyVoice3InputError, match="not both"):
        request_mode("hi", "speak fast")
    with pytest.raises(CosyVoice3InputError, match="transcript"):
        prompt_ids(tokenizer, "zero_shot", "text")
    with pytest.raises(CosyVoice3InputError, match="instruction"):
        prompt_ids(tokenizer, "instruct", "text")
