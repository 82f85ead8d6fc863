"""Properties of the gateway's segmenter (hypothesis): every input of 1-4096 characters that holds something to say
becomes segments the pipeline accepts, nothing speakable is lost, and nothing unspeakable is sent."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speech_text.segment import bound_segment, is_speakable, pipeline_segments, utf8_token_bound
from gateway.schemas import MAX_INPUT_CHARS
from pipeline_contract import MAX_SEGMENT_TOKENS

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Text with the scripts and separators that matter: Latin, CJK, Cyrillic, Arabic, combining marks, emoji,
#: sentence and clause punctuation, spaces and newlines.
_ALPHABET = st.sampled_from(
    list("abcdefghij ABC xyz,.;:!?'\"-—…\n\t0123456789")
    + list("中文测试句子，。！？、；：")
    + list("привет مرحبا")
    + ["e\u0301", "\u0915\u093c", "😀", "👍🏽", "\u2126", "\u0958"]
)
texts = st.lists(_ALPHABET, min_size=1, max_size=MAX_INPUT_CHARS // 2).map("".join).map(lambda t: t[:MAX_INPUT_CHARS])


def _letters(text: str) -> str:
    """The speakable characters in order, NFC (what a listener could hear)."""
    return "".join(c for c in unicodedata.normalize("NFC", text) if unicodedata.category(c)[0] in "LN")


@PROPERTY
@given(text=texts)
def test_every_segment_is_under_the_pipeline_limit_and_speakable(text):
    segments = pipeline_segments(text, MAX_SEGMENT_TOKENS)
    assert all(utf8_token_bound(s) <= MAX_SEGMENT_TOKENS for s in segments)
    assert all(is_speakable(s) for s in segments)
    assert bool(segments) == is_speakable(text)


@PROPERTY
@given(text=texts, limit=st.integers(min_value=8, max_value=400))
def test_bounding_only_cuts_it_never_drops_or_reorders(text, limit):
    pieces = bound_segment(text, limit)
    assert "".join(pieces) == text
    assert all(utf8_token_bound(p) <= limit for p in pieces)


@PROPERTY
@given(words=st.lists(st.text(alphabet="abcdefghijklmnop", min_size=1, max_size=12), min_size=1, max_size=400))
def test_run_on_words_are_cut_between_words(words):
    text = " ".join(words)
    for piece in bound_segment(text, 60):
        assert piece.strip().split() == [w for w in piece.split()]  # whole words only
    assert " ".join("".join(bound_segment(text, 60)).split()) == text


@PROPERTY
@given(text=texts)
def test_the_segments_keep_every_speakable_character_in_order(text):
    """English digit runs are spelled out by normalization, so compare only digit-free text."""
    text = "".join(c for c in text if not c.isdigit())
    assert _letters("".join(pipeline_segments(text, MAX_SEGMENT_TOKENS))) == _letters(text)


@pytest.mark.parametrize(
    "text",
    [
        " ".join(["word"] * 300),  # 1,500 characters of words without sentence punctuation
        ", ".join(["apples"] * 500)[:4000],  # a 4,000-character comma list
        "中" * 560,  # Chinese without punctuation
        "x" * 4096,  # one 4,096-character "word"
    ],
)
def test_the_reported_run_on_inputs_fit_the_real_tokenizer(tmp_path_factory, text):
    """The bound holds for a real byte-level BPE tokenizer (the tiny model's, loaded like CosyVoice-BlankEN)."""
    pytest.importorskip("transformers")
    from speech_lm.testing import write_test_tokenizer
    from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer

    tokenizer = CosyVoice2Tokenizer(write_test_tokenizer(tmp_path_factory.mktemp("tok")))
    segments = pipeline_segments(text, MAX_SEGMENT_TOKENS)
    assert len(segments) > 1
    assert all(tokenizer.count(s) <= utf8_token_bound(s) <= MAX_SEGMENT_TOKENS for s in segments)


def test_nothing_speakable_gives_no_segments():
    for text in ("?!... ,,, ;;; --- !!!", "😀😀😀", " \n\t ", "—…", "👍🏽 🎉"):
        assert pipeline_segments(text, MAX_SEGMENT_TOKENS) == []
