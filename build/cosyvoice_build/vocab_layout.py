"""Build-side names of the extended LLM vocabulary: token strings, the logits bias file, the chat template.

The id layout itself is `cosyvoice2.vocab.SpeechVocabLayout`, shared with the serving code.
"""

from __future__ import annotations

from cosyvoice2.vocab import (
    END_TOKENS, LAYOUT_FILE, LOGITS_BIAS_FILE, LOGITS_BIAS_KEY, VOCAB_PAD_MULTIPLE, SpeechVocabLayout,
)  # fmt: skip

__all__ = [
    "CHAT_TEMPLATE", "END_TOKENS", "LAYOUT_FILE", "LOGITS_BIAS_FILE", "LOGITS_BIAS_KEY", "MASKED_LOGIT_BIAS",
    "SOS_TOKEN", "TASK_ID_TOKEN", "VOCAB_PAD_MULTIPLE", "SpeechVocabLayout", "speech_token_name",
]

MASKED_LOGIT_BIAS = -1.0e9
SOS_TOKEN = "<|sos|>"
TASK_ID_TOKEN = "<|task_id|>"
#: The prompt format the TRT-LLM runtime feeds: <|sos|> text <|task_id|>, then prompt speech tokens as ids.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<|sos|>' + message['content'] + '<|task_id|>' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] }}{%- endif %}"
    "{%- endfor %}"
)


def speech_token_name(k: int) -> str:
    return f"<|s_{k}|>"
