"""Which of CosyVoice2's three voice modes a request uses, and what its LLM reads before the target text.

The reference assembles the LLM prefix ``[SOS, prompt text ids, target text ids, TASK_ID, prompt speech ids]``
(docs/engine.md, "Voice modes") and fills it per mode:

* **zero-shot** (a voice with its transcript): prompt text = the normalized transcript, then the
  reference's speech tokens after TASK_ID; the LLM continues the recording.
* **cross-lingual** (a voice without transcript): no prompt text and no prompt speech tokens; the voice
  only reaches the audio through the flow's prompt (speech tokens, mel and speaker embedding).
* **instruct** (an instruction such as "Speak slowly and sadly"): prompt text = the instruction ending in
  ``<|endofprompt|>`` (not normalized: the reference skips its text frontend for text with special tokens),
  no prompt speech tokens; the flow's prompt is the voice's as in the other modes. The transcript is unused.

The flow (token2wav) gets the same voice prompt in all three modes. This module is pure Python so that
the Triton-free orchestrator and the in-process engine share it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from cosyvoice2.text.tokenizer import ENDOFPROMPT
from speech_text.normalize import normalize


class VoiceMode(str, Enum):
    ZERO_SHOT = "zero_shot"
    CROSS_LINGUAL = "cross_lingual"
    INSTRUCT = "instruct"


@dataclass(frozen=True)
class LLMPrompt:
    """The mode-dependent part of the LLM prefix."""

    mode: VoiceMode
    text: str  # read between SOS and the target text ("" = nothing)
    speech_tokens: bool  # whether the voice's prompt speech tokens follow TASK_ID


def instruction_text(instruction: str) -> str:
    """The instruction as the LLM reads it: stripped and ending in exactly one ``<|endofprompt|>``."""
    text = instruction.strip()
    while text.endswith(ENDOFPROMPT):
        text = text[: -len(ENDOFPROMPT)].rstrip()
    return text + ENDOFPROMPT


def llm_prompt(transcript: str, instruction: str = "") -> LLMPrompt:
    """The mode and LLM prompt part for a voice's transcript ("" = none) and an instruction ("" = none).

    An instruction wins over the transcript (the reference's instruct mode never reads it).
    """
    if instruction.strip():
        return LLMPrompt(VoiceMode.INSTRUCT, instruction_text(instruction), speech_tokens=False)
    if transcript.strip():
        return LLMPrompt(VoiceMode.ZERO_SHOT, normalize(transcript), speech_tokens=True)
    return LLMPrompt(VoiceMode.CROSS_LINGUAL, "", speech_tokens=False)
