"""Split normalized text into synthesis segments by CosyVoice2's frontend rules
(docs/reference/cosyvoice2.md#text-normalization-and-segmentation). Pure Python.

``segment_text`` = upstream ``text_normalize(text, split=True)``: normalize (``normalize.py``), cut into sentences,
greedily merge sentences into segments of about 60..80 length units, and drop punctuation-only segments.
Length units are characters for Chinese and Qwen2 tokens for everything else. The token counter is pluggable:
pass a loaded tokenizer's count (the engine passes ``CosyVoice2Tokenizer.count``); without one (the gateway),
``approximate_token_count`` estimates it.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Callable, Literal

from speech_text.normalize import contains_chinese, has_special_tokens, normalize_en, normalize_zh

TokenCounter = Callable[[str], int]
Language = Literal["zh", "en"]

TERMINATORS: dict[str, tuple[str, ...]] = {
    "zh": ("。", "？", "！", "；", "：", "、", ".", "?", "!", ";"),
    "en": (".", "?", "!", ";", ":"),
}
_DEFAULT_END = {"zh": "。", "en": "."}
_CLOSING_QUOTES = ('"', "”")

# Pieces of Qwen2's byte-level BPE pre-tokenizer (contractions, words with one leading non-letter, single digits,
# symbol runs, whitespace), written with stdlib ``re``: letters are ``[^\W\d_]``.
_PRETOKEN = re.compile(
    r"'(?:s|t|re|ve|m|ll|d)|[^\r\n\w]?[^\W\d_]+|\d| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", re.IGNORECASE
)
_LETTERS_PER_TOKEN = 6  # long or rare English words split into several BPE pieces


def approximate_token_count(text: str) -> int:
    """Estimate of the Qwen2 token count of ``text`` without the tokenizer.

    One token per pre-tokenizer piece, plus one per further ``_LETTERS_PER_TOKEN`` letters of long ASCII words;
    non-ASCII letters count one token each (byte-level BPE rarely merges them into long pieces).
    """
    count = 0
    for piece in _PRETOKEN.findall(text):
        letters = sum(1 for c in piece if c.isalpha())
        if letters and not piece.isascii():
            count += max(1, sum(1 for c in piece if c.isalpha() and not c.isascii()))
        else:
            count += max(1, math.ceil(letters / _LETTERS_PER_TOKEN))
    return count


def is_punctuation_only(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), including the empty string."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


def _sentences(text: str, terminators: tuple[str, ...]) -> list[str]:
    """Cut after every terminator; a closing quote right after it stays with the sentence.

    As upstream: the text between two consecutive terminators must be non-empty, so the second terminator of
    "?!" is dropped.
    """
    sentences: list[str] = []
    start = 0
    i = 0
    while i < len(text):
        if text[i] in terminators:
            if i > start:
                sentences.append(text[start:i] + text[i])
            start = i + 1
            if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES and sentences:
                sentences[-1] += text[i + 1]
                start = i + 2
        i += 1
    return sentences


def split_paragraph(
    text: str,
    lang: Language,
    token_count: TokenCounter | None = None,
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    comma_split: bool = False,
) -> list[str]:
    """Upstream ``split_paragraph``: sentences merged greedily into segments.

    A segment is closed before the next sentence when the merged length would exceed ``token_max_n`` and the
    segment is already longer than ``token_min_n``; a final remainder shorter than ``merge_len`` joins the previous
    segment. Length = characters for ``zh``, ``token_count`` (default ``approximate_token_count``) otherwise.
    """
    if not text:
        return []
    measure: TokenCounter = len if lang == "zh" else (token_count or approximate_token_count)
    terminators = TERMINATORS[lang] + (("，", ",") if comma_split else ())
    if text[-1] not in terminators:
        text += _DEFAULT_END[lang]

    segments: list[str] = []
    current = ""
    for sentence in _sentences(text, terminators):
        if measure(current + sentence) > token_max_n and measure(current) > token_min_n:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and measure(current) < merge_len:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def segment_text(text: str, token_count: TokenCounter | None = None) -> list[str]:
    """Normalize ``text`` and split it into synthesis segments (upstream ``text_normalize(split=True)``).

    Text with special tokens (``<|...|>``) is returned whole and unnormalized, as upstream does; empty or
    whitespace-only text gives ``[]``.
    """
    if has_special_tokens(text):
        return [text]
    text = text.strip()
    if not text:
        return []
    if contains_chinese(text):
        segments = split_paragraph(normalize_zh(text), "zh")
    else:
        segments = split_paragraph(normalize_en(text), "en", token_count)
    return [s for s in segments if not is_punctuation_only(s)]


# -- segments the pipeline always accepts -------------------------------------------------------------------------
# The pipeline refuses a segment above its target-text token limit. Upstream's merge rules bound *merged* sentences
# but not one long sentence (run-on text, a comma list, Chinese without punctuation), so the gateway splits further,
# at the best boundary each piece has, until every segment is provably under the limit.

#: Cut points, best first: sentence ends, clause marks, whitespace. Below those: characters.
_SENTENCE_ENDS = frozenset(
    TERMINATORS["zh"] + TERMINATORS["en"] + ("…", "‼", "⁇", "⁈", "⁉", "｡", "．", "？", "！")
)
_CLAUSE_MARKS = frozenset(",，、:：;；—–)]}）】」』》〉\"”’'")


def utf8_token_bound(text: str) -> int:
    """An upper bound of the Qwen2 token count of ``text`` that needs no tokenizer.

    Qwen2's tokenizer NFC-normalizes, then runs byte-level BPE: every token covers at least one UTF-8 byte (merges
    only join bytes; special tokens are whole multi-byte strings), so the NFC byte length bounds the count.
    """
    return len(unicodedata.normalize("NFC", text).encode("utf-8"))


def is_speakable(text: str) -> bool:
    """True when ``text`` holds something to say: a letter or a number (Unicode L* or N*).

    Punctuation, symbols, emoji and whitespace alone are not speech; a segment of only those is dropped, and an input
    of only those is refused, whatever mix of them it is.
    """
    return any(unicodedata.category(c)[0] in "LN" for c in text)


def _cut_after(text: str, marks: frozenset[str]) -> list[str]:
    """Pieces ending right after each run of ``marks`` (the marks stay with the text before them)."""
    pieces: list[str] = []
    start = 0
    for i, char in enumerate(text):
        if char in marks and (i + 1 == len(text) or text[i + 1] not in marks):
            pieces.append(text[start : i + 1])
            start = i + 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _cut_words(text: str) -> list[str]:
    """Pieces ending after each whitespace run (a word keeps the space that follows it)."""
    return [m.group(0) for m in re.finditer(r"\S+\s*|\s+", text)]


def _cut_characters(text: str) -> list[str]:
    """Characters, each with the combining marks that follow it (never split a base from its accents)."""
    pieces: list[str] = []
    for char in text:
        if pieces and unicodedata.category(char).startswith("M"):
            pieces[-1] += char
        else:
            pieces.append(char)
    return pieces


_CUTTERS: tuple[Callable[[str], list[str]], ...] = (
    lambda text: _cut_after(text, _SENTENCE_ENDS),
    lambda text: _cut_after(text, _CLAUSE_MARKS),
    _cut_words,
    _cut_characters,
)


def bound_segment(
    text: str, max_tokens: int, token_bound: TokenCounter = utf8_token_bound, level: int = 0
) -> list[str]:
    """``text`` in pieces of at most ``max_tokens`` by ``token_bound``, cut at the best boundary available.

    Pieces are packed greedily, so a long text keeps as few, as long segments as the limit allows.
    """
    if token_bound(text) <= max_tokens:
        return [text]
    if level >= len(_CUTTERS):
        raise ValueError(f"a single character is above the limit of {max_tokens} tokens")
    segments: list[str] = []
    current = ""
    for piece in _CUTTERS[level](text):
        if token_bound(current + piece) <= max_tokens:
            current += piece
            continue
        if current:
            segments.append(current)
        if token_bound(piece) <= max_tokens:
            current = piece
        else:
            *whole, current = bound_segment(piece, max_tokens, token_bound, level + 1)
            segments.extend(whole)
    if current:
        segments.append(current)
    return segments


def pipeline_segments(
    text: str,
    max_tokens: int,
    token_count: TokenCounter | None = None,
    token_bound: TokenCounter = utf8_token_bound,
) -> list[str]:
    """``segment_text`` made safe for the pipeline: every segment is speakable and at most ``max_tokens`` tokens
    by ``token_bound`` (an upper bound of the pipeline tokenizer's count, or the count itself). ``[]`` when the text
    holds nothing to speak."""
    segments: list[str] = []
    for segment in segment_text(text, token_count):
        for piece in bound_segment(segment, max_tokens, token_bound):
            piece = piece.strip()
            if is_speakable(piece):
                segments.append(piece)
    return segments
