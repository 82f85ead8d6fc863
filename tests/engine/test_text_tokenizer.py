"""CosyVoice2 tokenizer: special-token ids (docs/reference/cosyvoice2.md#text-tokenizer-and-special-tokens) and plain
encoding without BOS/EOS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speech_lm.testing import write_test_tokenizer
from cosyvoice2.text.tokenizer import ADDITIONAL_SPECIAL_TOKENS, CosyVoice2Tokenizer

RELEASED_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|endofprompt|>": 151646, "[breath]": 151647, "<strong>": 151648, "</strong>": 151649, "[noise]": 151650,
    "[laughter]": 151651, "[cough]": 151652, "[clucking]": 151653, "[accent]": 151654, "[quick_breath]": 151655,
    "<laughter>": 151656, "</laughter>": 151657, "[hissing]": 151658, "[sigh]": 151659,
    "[vocalized-noise]": 151660, "[lipsmack]": 151661, "[mn]": 151662,
}


@pytest.fixture(scope="module")
def released_size_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer directory whose base vocabulary has the released size (151643 entries)."""
    model_dir = tmp_path_factory.mktemp("model")
    write_test_tokenizer(model_dir / "CosyVoice-BlankEN", base_vocab_size=151643)
    return model_dir


def test_special_token_ids_equal_the_released_ones(released_size_dir: Path) -> None:
    tokenizer = CosyVoice2Tokenizer.from_model_dir(released_size_dir)
    assert len(tokenizer) == 151663
    assert {token: tokenizer.token_id(token) for token in RELEASED_IDS} == RELEASED_IDS
    assert set(ADDITIONAL_SPECIAL_TOKENS) <= set(RELEASED_IDS)


def test_encode_adds_no_bos_or_eos_and_keeps_special_tokens_whole(released_size_dir: Path) -> None:
    tokenizer = CosyVoice2Tokenizer.from_model_dir(released_size_dir)
    vocab = json.loads((released_size_dir / "CosyVoice-BlankEN" / "vocab.json").read_text(encoding="utf-8"))
    assert tokenizer.encode("Hello world") == [vocab["Hello"], vocab["Ġworld"]]
    assert tokenizer.encode("a<|endofprompt|>b[breath]") == [vocab["a"], 151646, vocab["b"], 151647]
    assert tokenizer.count("Hello world") == 2


def test_small_tokenizer_puts_specials_right_after_its_vocabulary(tmp_path: Path) -> None:
    tokenizer = CosyVoice2Tokenizer(write_test_tokenizer(tmp_path))
    vocab_size = len(json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8")))
    assert tokenizer.token_id("<|endoftext|>") == vocab_size
    assert tokenizer.token_id("<|endofprompt|>") == vocab_size + 3
    assert tokenizer.token_id("[mn]") == vocab_size + 19
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
