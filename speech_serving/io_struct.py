"""The data the serving processes hand each other: one module, so every component (orchestrator, voice prompt,
LLM, token2wav, their Triton adapters and tensor conversions; Spark-TTS's alike) speaks of the same types.

The gateway-facing types (`SpeechRequest`, `SpeechChunk`) are the pipeline contract's (`pipeline_contract`).
numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptTensors:
    """What the LLM and token2wav need about a voice (docs/reference/cosyvoice2.md#inputs-per-voice): 1:2-aligned
    tokens and mel, x-vector."""

    speech_tokens: np.ndarray  # int32 (P,), speech ids 0..speech_token_size-1
    mel: np.ndarray  # float32 (2P, 80), 24 kHz prompt mel
    embedding: np.ndarray  # float32 (192,) x-vector


@dataclass(frozen=True)
class LLMRequest:
    """Inputs of one LLM sequence, in the form both LLM backends take (TensorRT-LLM names in the adapter)."""

    input_ids: np.ndarray  # int32 [SOS, prompt text ids, target ids, TASK_ID, prompt speech ids + offset]
    min_tokens: int  # EOS is masked before this many tokens (2 x target text tokens)
    max_tokens: int  # 20 x target text tokens, clamped to the KV capacity
    seed: int
    top_k: int
    top_p: float
    temperature: float
    streaming: bool
    # Cumulative token counts at which the orchestrator needs the tokens decoded so far (the streaming
    # schedule's chunk boundaries; empty: only at the end). An LLM that can buffer answers only there.
    deliver_at: tuple[int, ...] | None = None


# -- Spark-TTS (`speech_serving.spark`) ------------------------------------------------------------------------
@dataclass(frozen=True)
class SparkVoicePrompt:
    """A Spark voice: what the audio tokenizer computes once per voice id."""

    global_tokens: np.ndarray  # int32 [32]
    semantic_tokens: np.ndarray  # int32 [frames], 50 per second of reference


@dataclass(frozen=True)
class SparkLLMRequest:
    """Inputs of one Spark LLM sequence."""

    prompt_ids: np.ndarray  # int32, the whole prompt
    max_new_tokens: int
    seed: int
    deliver_at: tuple[int, ...] | None  # token counts at which the caller needs its tokens; () = only the end
    streaming: bool = False  # for a streaming response (TensorRT-LLM then answers per token, `deliver_at` unused)
