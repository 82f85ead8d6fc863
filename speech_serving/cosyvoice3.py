"""CosyVoice3 behind the pipeline contract: CosyVoice2's request state machine (`speech_serving.orchestrator`) with
CosyVoice3's LLM texts, LLM vocabulary and streaming schedule. Torch-free (the entry models run no model).

What differs from CosyVoice2 (docs/cosyvoice3.md, "Serving"):

* the LLM texts of the three modes (`cosyvoice3.prompts`): every text holds `<|endofprompt|>` after the system
  prompt or the instruction; cross-lingual requests carry the system prompt in the text itself;
* the mode follows from the request as CosyVoice2's does (`cosyvoice2.frontend.llm_prompt`): an instruction wins
  (the transcript is then unused), else a transcript gives zero-shot, else cross-lingual;
* the LLM's wire vocabulary (`cosyvoice3_vocab`): the merged vocabulary of the converted checkpoint (text ids below
  the Qwen2 text embedding's rows, speech ids after them, then the 200 special ids); the PyTorch LLM model maps
  them to `CosyVoice3LM`'s inputs, a TensorRT-LLM engine reads them as they are;
* the streaming schedule (`cosyvoice3_schedule`): the served runtime's 15, 25, 50, 100, ... tokens (no cap, no
  alignment to the prompt), 3 lookahead tokens.
"""

from __future__ import annotations

import numpy as np

from cosyvoice2.frontend.llm_prompt import VoiceMode, instruction_text, llm_prompt
from cosyvoice2.streaming import ChunkSchedule
from cosyvoice2.text.tokenizer import ENDOFPROMPT
from cosyvoice3.config import CosyVoice3Config
from cosyvoice3.prompts import cross_lingual_text, instruct_prompt, zero_shot_prompt
from cosyvoice3.vocab import CosyVoice3VocabLayout
from speech_serving.io_struct import PromptTensors
from speech_serving.orchestrator import Orchestrator
from pipeline_contract import SpeechRequest

#: Hops double without a cap in the served schedule: this only has to exceed any stream's length.
UNCAPPED_HOP = 1 << 30


def cosyvoice3_vocab(config: CosyVoice3Config) -> CosyVoice3VocabLayout:
    """The flat ids the orchestrator and the LLM model exchange: the merged vocabulary (`cosyvoice3.vocab`), text
    ids below the text embedding's rows, then the speech tokens, then the 200 special ids (sos and task among
    them). The PyTorch LLM model takes the text and speech parts apart again; a TensorRT-LLM engine built from
    the converted checkpoint reads them as they are. Neither emits a special id as audio: each ends a sequence."""
    return CosyVoice3VocabLayout(text_vocab_size=config.llm.qwen.vocab_size,
                                 speech_token_size=config.llm.speech_token_size,
                                 num_special_tokens=config.llm.num_special_tokens)


def cosyvoice3_schedule(config: CosyVoice3Config, first_hop: int = 15, second_hop: int = 25) -> ChunkSchedule:
    """The served runtime's chunks: `first_hop` tokens, then `second_hop` doubling per chunk without a cap, each
    non-final chunk with the flow's lookahead; grid 1: no chunk is padded to the prompt's length."""
    return ChunkSchedule(first_hop=first_hop, second_hop=second_hop, grid=1, max_hop=UNCAPPED_HOP, growth=2,
                         lookahead=config.flow.pre_lookahead_len)


def _instruction(instruction: str) -> str:
    """The instruction as CosyVoice2 reads it (stripped, a trailing `<|endofprompt|>` dropped), without the marker:
    `instruct_prompt` places it."""
    return instruction_text(instruction)[: -len(ENDOFPROMPT)]


class CosyVoice3Orchestrator(Orchestrator):
    """`Orchestrator` with CosyVoice3's LLM texts (see the module docstring); the rest is CosyVoice2's."""

    def llm_texts(self, request: SpeechRequest, prompt: PromptTensors) -> tuple[list[int], list[int], np.ndarray]:
        """(prompt text ids, text ids, prompt speech ids): the length limits count the text ids, which in
        cross-lingual mode hold the system prompt (as in the reference)."""
        encode = self.tokenizer.encode
        target_ids = self.target_ids(request)
        mode = llm_prompt(request.reference_text, request.instruction)
        if mode.mode is VoiceMode.ZERO_SHOT:  # mode.text: the normalized transcript, as CosyVoice2 reads it
            speech_ids = self.config.vocab.to_vocab_ids(prompt.speech_tokens)
            return encode(zero_shot_prompt(mode.text)), target_ids, speech_ids
        no_speech = np.zeros(0, dtype=np.int32)
        if mode.mode is VoiceMode.INSTRUCT:
            return encode(instruct_prompt(_instruction(request.instruction))), target_ids, no_speech
        return [], encode(cross_lingual_text(request.target_text)), no_speech
