"""Text normalization of CosyVoice2's frontend (docs/reference/cosyvoice2.md#text-normalization-and-segmentation),
pure Python (stdlib + ``inflect``, imported lazily).

Upstream first runs an optional external normalizer (``ttsfrd`` if installed, else ``wetext``) and then fixed rules.
We do not depend on either engine: we apply only the fixed rules, i.e. upstream's behaviour when neither is
installed. Consequences: Chinese numbers, dates, units and symbols are left as written (wetext would verbalise
them); English numbers are still spelled out digit run by digit run with ``inflect`` like upstream, but
currencies, ordinals ("1st") and abbreviations are not expanded.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

_CHINESE_CHAR = re.compile(r"[\u4e00-\u9fff]")
_DIGIT_RUN = re.compile(r"[0-9]+")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
# Upstream skips the whole frontend for text carrying special tokens such as <|endofprompt|>.
_SPECIAL_OPEN, _SPECIAL_CLOSE = "<|", "|>"


def contains_chinese(text: str) -> bool:
    """True if any character is in the CJK Unified Ideographs block (U+4E00..U+9FFF)."""
    return _CHINESE_CHAR.search(text) is not None


def has_special_tokens(text: str) -> bool:
    return _SPECIAL_OPEN in text and _SPECIAL_CLOSE in text


def _remove_blanks(text: str) -> str:
    """Delete spaces except those with a non-space ASCII character on both sides (keeps spaces inside English)."""
    kept = []
    for i, char in enumerate(text):
        if char == " ":
            before = text[i - 1] if i > 0 else ""
            after = text[i + 1] if i + 1 < len(text) else ""
            if not (before.isascii() and before not in ("", " ") and after.isascii() and after not in ("", " ")):
                continue
        kept.append(char)
    return "".join(kept)


def normalize_zh(text: str) -> str:
    """Upstream's fixed Chinese cleanup rules, in upstream's order."""
    text = text.replace("\n", "")
    text = _remove_blanks(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。")
    text = text.replace(" - ", "，")
    for bracket in ("（", "）", "【", "】", "`"):
        text = text.replace(bracket, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


@cache
def _inflect_engine() -> Any:
    import inflect  # slow import (~2 s): only when English digits actually occur

    return inflect.engine()


def spell_out_numbers(text: str) -> str:
    """Replace every maximal run of ASCII digits by its English words ("2024" -> "two thousand and twenty-four")."""
    if not _DIGIT_RUN.search(text):
        return text
    engine = _inflect_engine()
    return _DIGIT_RUN.sub(lambda m: engine.number_to_words(m.group(0)), text)


def normalize_en(text: str) -> str:
    return spell_out_numbers(text)


def normalize(text: str) -> str:
    """Normalize one text without splitting it (what upstream does to the prompt transcript)."""
    if has_special_tokens(text):
        return text
    text = text.strip()
    if not text:
        return text
    return normalize_zh(text) if contains_chinese(text) else normalize_en(text)
