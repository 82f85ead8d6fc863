"""The three CosyVoice3 request modes and the texts they give the LLM (torch-free: the serving orchestrator builds
its requests with them in a process that never runs a model).

Every text the LLM reads (prompt text ++ text) contains `<|endofprompt|>`, which separates the system prompt or
instruction from what is spoken; `zero_shot_prompt`, `instruct_prompt` and `cross_lingual_text` build the three
formats (docs/cosyvoice3.md, "LLM").
"""

from __future__ import annotations

from typing import Literal

from .config import ENDOFPROMPT, SYSTEM_PROMPT

Mode = Literal["zero_shot", "cross_lingual", "instruct"]


def zero_shot_prompt(transcript: str) -> str:
    """Prompt text of a zero-shot request: the system prompt, `<|endofprompt|>`, the prompt audio's transcript."""
    return f"{SYSTEM_PROMPT}{ENDOFPROMPT}{transcript}"


def instruct_prompt(instruction: str) -> str:
    """Prompt text of an instruct request (dialect, speed, emotion, role ...): no prompt speech goes to the LLM."""
    return f"{SYSTEM_PROMPT} {instruction}{ENDOFPROMPT}"


def cross_lingual_text(text: str) -> str:
    """The whole LLM text of a cross-lingual / fine-grained request (no prompt text, no prompt speech); the
    system prompt counts towards the length limits here, as in the reference."""
    return text if ENDOFPROMPT in text else f"{SYSTEM_PROMPT}{ENDOFPROMPT}{text}"
