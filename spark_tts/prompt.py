"""Spark's LLM vocabulary and prompt: the special-token prompt string, its ids, and generated ids back to
semantic tokens.

Zero-shot prompt (voice cloning with the reference transcript, what the served runtime always builds)::

    <|task_tts|><|start_content|>{reference_text}{target_text}<|end_content|>
    <|start_global_token|>{32 x <|bicodec_global_g|>}<|end_global_token|>
    <|start_semantic_token|>{<|bicodec_semantic_s|> per reference frame}

(one string, no separators: the transcript and the target text are joined as they are). Without a transcript
the prompt ends after ``<|end_global_token|>`` and the speaker comes from the global tokens alone. The LLM
continues with ``<|bicodec_semantic_k|>`` tokens and stops at ``<|im_end|>``.

Token ids are never hard-coded: the release and the test models number their added tokens differently, so every
id comes from the tokenizer file. The prompt is tokenised as a string (the added tokens split it, the text in
between goes through byte-level BPE), which gives exactly the served runtime's ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tokenizers import Tokenizer

from spark_tts import layout
from spark_tts.errors import SparkInputError, SparkModelError

TASK_TTS = "<|task_tts|>"
START_CONTENT, END_CONTENT = "<|start_content|>", "<|end_content|>"
START_GLOBAL, END_GLOBAL = "<|start_global_token|>", "<|end_global_token|>"
START_SEMANTIC = "<|start_semantic_token|>"
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
NUM_GLOBAL_CODES, NUM_SEMANTIC_CODES = 4096, 8192

_SEMANTIC = re.compile(r"<\|bicodec_semantic_(\d+)\|>")


def global_token(code: int) -> str:
    return f"<|bicodec_global_{code}|>"


def semantic_token(code: int) -> str:
    return f"<|bicodec_semantic_{code}|>"


def build_prompt(
    target_text: str,
    global_tokens: Sequence[int],
    reference_text: str | None = None,
    reference_semantic_tokens: Sequence[int] = (),
) -> str:
    """The zero-shot prompt string. ``reference_text`` None: the transcript-free form (global tokens only)."""
    if not target_text:
        raise SparkInputError("the text to speak is empty")
    parts = [TASK_TTS, START_CONTENT]
    if reference_text is not None:
        parts.append(reference_text)
    parts += [target_text, END_CONTENT, START_GLOBAL, *(global_token(int(g)) for g in global_tokens), END_GLOBAL]
    if reference_text is not None:
        parts += [START_SEMANTIC, *(semantic_token(int(s)) for s in reference_semantic_tokens)]
    return "".join(parts)


@dataclass(frozen=True)
class SparkVocab:
    """The ids the engine needs, read from the LLM tokenizer."""

    eos_id: int
    pad_id: int
    semantic_base: int  # id of <|bicodec_semantic_0|>; the 8192 semantic tokens are contiguous from there
    global_base: int


class SparkTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)

        def need(token: str) -> int:
            if token not in vocab:
                raise SparkModelError(f"LLM tokenizer lacks {token}")
            return vocab[token]

        semantic_base, global_base = need(semantic_token(0)), need(global_token(0))
        # the mapping ids <-> codes relies on contiguous ranges: check both ends and a middle code
        for base, make, count in ((semantic_base, semantic_token, NUM_SEMANTIC_CODES),
                                  (global_base, global_token, NUM_GLOBAL_CODES)):
            for code in (1, count // 2, count - 1):
                if need(make(code)) != base + code:
                    raise SparkModelError(f"LLM tokenizer: {make(code)} is not at id {base + code}")
        for token in (TASK_TTS, START_CONTENT, END_CONTENT, START_GLOBAL, END_GLOBAL, START_SEMANTIC):
            need(token)
        self.vocab = SparkVocab(eos_id=need(EOS_TOKEN), pad_id=need(PAD_TOKEN),
                                semantic_base=semantic_base, global_base=global_base)

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> "SparkTokenizer":
        return cls(Tokenizer.from_file(str(model_dir / layout.LLM_TOKENIZER_FILE)))

    def encode(self, prompt: str) -> list[int]:
        """Prompt string -> LLM ids (no BOS: Qwen2 adds none)."""
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def prompt_ids(
        self,
        target_text: str,
        global_tokens: Sequence[int],
        reference_text: str | None = None,
        reference_semantic_tokens: Sequence[int] = (),
    ) -> list[int]:
        return self.encode(build_prompt(target_text, global_tokens, reference_text, reference_semantic_tokens))

    def semantic_ids(self, codes: Iterable[int]) -> list[int]:
        """Semantic codes -> their LLM ids (teacher forcing, tests)."""
        return [self.vocab.semantic_base + int(c) for c in codes]

    def semantic_codes(self, ids: Iterable[int] | torch.Tensor) -> list[int]:
        """Generated LLM ids -> semantic codes, in order. Anything that is not a ``<|bicodec_semantic_k|>``
        token (eos, specials, global tokens, plain text) is dropped, as the served runtime's decode-and-regex
        does for these cases; unlike it, plain text that happens to spell a token name never becomes a code."""
        base = self.vocab.semantic_base
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return [int(i) - base for i in values if base <= int(i) < base + NUM_SEMANTIC_CODES]

    def benchmark_codes(self, ids: Iterable[int] | torch.Tensor) -> list[int]:
        """Benchmark mode (random weights): every generated id is one semantic code, a semantic id its own code
        and any other id ``id % NUM_SEMANTIC_CODES`` (a random LLM mostly draws non-semantic ids; dropping them
        would make the generated length, and so the benchmark's load, random)."""
        base = self.vocab.semantic_base
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return [int(i) - base if base <= int(i) < base + NUM_SEMANTIC_CODES else int(i) % NUM_SEMANTIC_CODES
                for i in values]

    @staticmethod
    def codes_in_text(text: str) -> list[int]:
        """Semantic codes spelled as token strings in ``text`` (inverse of ``build_prompt``'s semantic part)."""
        return [int(m) for m in _SEMANTIC.findall(text)]
