"""The CosyVoice3 text tokenizer: CosyVoice2's (Qwen2 byte-level BPE from ``CosyVoice-BlankEN``) with more specials.

The released tokenizer registers, after ``<|endoftext|>`` (eos/pad), in this order:

1. CosyVoice2's 19 specials (``<|im_start|>``, ``<|im_end|>``, ``<|endofprompt|>``, the paralinguistic marks
   ``[breath]`` ... ``[mn]``); the first two already exist in the base vocabulary, so ``<|endofprompt|>`` is 151646
   as in CosyVoice2 (the LLM requires it in every text);
2. ``<|endofsystem|>``;
3. CMU (ARPAbet) phones in brackets: every vowel with its stress digit 0/1/2 (``[AA0]`` ``[AA1]`` ``[AA2]``),
   consonants without one (``[B]``);
4. pinyin in brackets: the initials (``[zh]``) and the finals with their tone marked on the vowel that carries it
   (``[ā]``, ``[iǎo]``, ``[üè]``), tones 1-4 then the neutral tone unmarked (``[a]``), so a syllable is written
   as initial + final (``[j][ǐ]``).

Phones and pinyin are generated below from those rules (the standard ARPAbet inventory and the pinyin tone-mark
placement), not listed by hand. Every id is below the LLM's 151936-row text embedding. What the tests pin: the ids
up to ``<|endofsystem|>`` (CosyVoice2's list plus one), the layout of the three prompt formats; the order inside
groups 3 and 4 follows our generation rule (alphabetical ARPAbet; initials, then finals by tone).
"""

from __future__ import annotations

from typing import Sequence

from cosyvoice2.text.tokenizer import ADDITIONAL_SPECIAL_TOKENS as COSYVOICE2_SPECIAL_TOKENS
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer

from .config import SYSTEM_PROMPT
from .errors import CosyVoice3InputError
from .prompts import Mode, cross_lingual_text, instruct_prompt, zero_shot_prompt

ENDOFSYSTEM = "<|endofsystem|>"

#: The 15 ARPAbet vowels (they carry a lexical stress digit) and the 24 consonants (they do not).
ARPABET_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
ARPABET_CONSONANTS = ("B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH",
                      "T", "TH", "V", "W", "Y", "Z", "ZH")
ARPABET_STRESSES = (0, 1, 2)

PINYIN_INITIALS = ("b", "p", "m", "f", "d", "t", "n", "l", "g", "k", "h", "j", "q", "x", "zh", "ch", "sh", "r",
                   "z", "c", "s", "y", "w")
#: Finals as written after an initial (`v` stands for ü, as pinyin input methods do).
PINYIN_FINALS = ("a", "o", "e", "i", "u", "v", "ai", "ei", "ao", "ou", "an", "en", "ang", "eng", "ong", "er",
                 "ia", "ie", "iao", "iu", "ian", "in", "iang", "ing", "iong", "ua", "uo", "uai", "ui", "uan", "un",
                 "uang", "ve", "van", "vn")
#: Tone marks per vowel for tones 1 (flat) .. 4 (falling).
_TONE_MARKS = {"a": "āáǎà", "o": "ōóǒò", "e": "ēéěè", "i": "īíǐì", "u": "ūúǔù", "v": "ǖǘǚǜ"}


def _tone_vowel(final: str) -> int:
    """Index of the vowel that takes the tone mark: a or e if present, o in `ou`, otherwise the last vowel
    (so `iu` marks u and `ui` marks i)."""
    for vowel in ("a", "e"):
        if vowel in final:
            return final.index(vowel)
    if "ou" in final:
        return final.index("o")
    return max(i for i, ch in enumerate(final) if ch in _TONE_MARKS)


def toned_final(final: str, tone: int) -> str:
    """`final` with `tone` (1-4 marked, 5 neutral/unmarked) in written form: ``toned_final("iao", 3) == "iǎo"``."""
    if not 1 <= tone <= 5:
        raise ValueError(f"pinyin tone must be 1..5, got {tone}")
    chars = list(final)
    if tone < 5:
        at = _tone_vowel(final)
        chars[at] = _TONE_MARKS[chars[at]][tone - 1]
    return "".join(chars).replace("v", "ü")


def cmu_phone_tokens() -> tuple[str, ...]:
    """ARPAbet phones in alphabetical order, vowels once per stress digit: ``[AA0]`` .. ``[ZH]``."""
    phones = [f"{v}{s}" for v in ARPABET_VOWELS for s in ARPABET_STRESSES] + list(ARPABET_CONSONANTS)
    return tuple(f"[{p}]" for p in sorted(phones))


def pinyin_tokens() -> tuple[str, ...]:
    """The initials, then every final in tones 1-4 and neutral: ``[b]`` .. ``[zh]``, ``[ā]`` .. ``[ün]``."""
    finals = [toned_final(f, tone) for f in PINYIN_FINALS for tone in range(1, 6)]
    return tuple(f"[{p}]" for p in (*PINYIN_INITIALS, *finals))


#: Every special token the CosyVoice3 tokenizer registers, in registration order.
SPECIAL_TOKENS: tuple[str, ...] = (*COSYVOICE2_SPECIAL_TOKENS, ENDOFSYSTEM, *cmu_phone_tokens(), *pinyin_tokens())


class CosyVoice3Tokenizer(CosyVoice2Tokenizer):
    """Text -> token ids for CosyVoice3 (no BOS/EOS; special tokens and bracketed phones stay whole)."""

    special_tokens = SPECIAL_TOKENS


def prompt_ids(tokenizer: CosyVoice2Tokenizer, mode: Mode, text: str, reference_text: str | None = None,
               instruction: str | None = None) -> tuple[list[int], list[int]]:
    """(text ids, prompt text ids) of one request, the two texts tokenized separately as the reference does.

    zero_shot: prompt = system prompt + `<|endofprompt|>` + reference transcript; instruct: prompt = system
    prompt + " " + instruction + `<|endofprompt|>`; cross_lingual: no prompt, the text carries the system prompt.
    """
    if mode == "zero_shot":
        if not reference_text:
            raise CosyVoice3InputError("a zero_shot request needs the reference audio's transcript")
        return tokenizer.encode(text), tokenizer.encode(zero_shot_prompt(reference_text))
    if mode == "instruct":
        if not instruction:
            raise CosyVoice3InputError("an instruct request needs an instruction")
        return tokenizer.encode(text), tokenizer.encode(instruct_prompt(instruction))
    if mode == "cross_lingual":
        return tokenizer.encode(cross_lingual_text(text)), []
    raise CosyVoice3InputError(f"unknown mode {mode!r} (zero_shot, cross_lingual or instruct)")


def request_mode(reference_text: str | None, instruction: str | None) -> Mode:
    """The mode a request's fields select: an instruction -> instruct; a transcript -> zero_shot; neither ->
    cross_lingual (both at once is ambiguous and refused)."""
    if instruction and reference_text:
        raise CosyVoice3InputError(
            "give either a reference transcript (zero_shot) or an instruction (instruct), not both")
    if instruction:
        return "instruct"
    return "zero_shot" if reference_text else "cross_lingual"


__all__: Sequence[str] = ("CosyVoice3Tokenizer", "SPECIAL_TOKENS", "SYSTEM_PROMPT", "prompt_ids", "request_mode")
