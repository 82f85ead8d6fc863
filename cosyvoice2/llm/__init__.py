"""CosyVoice2 LLM: Qwen2 body, speech head, sampling and decoding."""

from cosyvoice2.llm.decode import (
    BatchedDecoder,
    DecodeRequest,
    NoFreeSlotError,
    SlotOutput,
    generate_tokens,
    required_seq_len,
    token_limits,
)
from cosyvoice2.llm.model import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.qwen2 import Qwen2Config, StaticKVCache
from cosyvoice2.llm.sampling import SamplingParams

__all__ = [
    "BatchedDecoder",
    "CosyVoice2LM",
    "DecodeRequest",
    "LLMConfig",
    "NoFreeSlotError",
    "Qwen2Config",
    "SamplingParams",
    "SlotOutput",
    "StaticKVCache",
    "generate_tokens",
    "required_seq_len",
    "token_limits",
]
