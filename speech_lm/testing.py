"""Writes a tiny Qwen2-style byte-level BPE tokenizer directory, a stand-in for the Qwen2 tokenizers the models on
the runtime ship (CosyVoice2's and CosyVoice3's ``CosyVoice-BlankEN``, the base of Spark-TTS's LLM tokenizer).
Torch-free.

The real directory holds ``vocab.json`` (151643 entries), ``merges.txt`` and ``tokenizer_config.json`` whose
``added_tokens_decoder`` declares ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` right after the vocabulary.
This writer reproduces that layout with a 256-symbol byte alphabet plus a handful of merges, so tests (and the tiny
model writers of the engines' ``testing`` modules) get a tokenizer that ``AutoTokenizer`` loads the same way as the real one.

``base_vocab_size`` pads the vocabulary with unreachable filler entries; with 151643 the special tokens land on the
released ids (``<|endoftext|>`` = 151643, ``<|endofprompt|>`` = 151646, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

# A few English merges so that common words become single tokens (exercises the BPE path, not only bytes).
_MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("Ġ", "s"), ("e", "r"), ("o", "n"),
    ("l", "l"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("Ġwor", "l"), ("Ġworl", "d"), ("H", "e"),
    ("He", "ll"), ("Hell", "o"), ("Ġ", "h"), ("Ġh", "e"), ("Ġhe", "ll"), ("Ġhell", "o"),
)

BASE_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_alphabet() -> list[str]:
    """The GPT-2 byte-to-unicode table: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_test_tokenizer(directory: str | Path, base_vocab_size: int | None = None) -> Path:
    """Write vocab.json, merges.txt and tokenizer_config.json into ``directory``; return the directory.

    base_vocab_size: total number of regular vocabulary entries (``None``: just bytes + merges). The three base
    special tokens get the ids right after it, as in the released tokenizer.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokens = _byte_alphabet() + ["".join(pair) for pair in _MERGES]
    if base_vocab_size is not None:
        if base_vocab_size < len(tokens):
            raise ValueError(f"base_vocab_size {base_vocab_size} < {len(tokens)} built-in tokens")
        tokens += [f"<filler_{i}>" for i in range(base_vocab_size - len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in _MERGES)
    (out / "merges.txt").write_text(merges, encoding="utf-8")
    added = {
        str(len(tokens) + i): {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for i, content in enumerate(BASE_SPECIAL_TOKENS)
    }
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out
