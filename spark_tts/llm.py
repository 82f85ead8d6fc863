"""The Spark LLM (Qwen2.5-0.5B with Spark's added tokens) on the shared batched decoder.

``SparkLM`` wraps our Qwen2 body (``speech_lm.qwen2``) and presents the interface that
``speech_lm.decode.BatchedDecoder`` drives (prefix embedding, token embedding, log-probs, KV cache), so
Spark requests get the same static KV cache, CUDA graphs and continuous batching as CosyVoice2's:

    decoder = BatchedDecoder(spark_lm, num_slots=16, max_seq_len=2048)
    slot = decoder.add(spark_request(prompt_ids, seed=7))
    ... decoder.step() ...   # generated ids are LLM ids; SparkTokenizer.semantic_codes maps them to codes

Sampling (the served runtime's request: temperature 0.8, top-k 50, top-p 0.95, no repetition penalty, stop at
``<|im_end|>``, at most 512 new tokens): ``log_probs`` divides the logits by the temperature and keeps the top-k
(ties at the k-th value kept), renormalised; the decoder's nucleus draw then keeps, from the most probable
down, every id whose preceding mass is below top-p. That is top-k then top-p over the renormalised top-k, as
Hugging Face's and TensorRT-LLM's samplers apply them. The decoder's repetition-aware resampling is off
(window 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speech_lm.decode import DecodeRequest
from speech_lm.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2Model, SpeechLM
from speech_lm.sampling import SamplingParams


@dataclass(frozen=True)
class SparkSampling:
    """Spark's decoding parameters (defaults: the served runtime's LLM request)."""

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    max_new_tokens: int = 512

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0")
        if self.top_k < 1 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError("top_k >= 1, 0 < top_p <= 1 and max_new_tokens >= 1 are required")


@dataclass(frozen=True)
class SparkLMConfig:
    """What the batched decoder reads from ``model.config``."""

    qwen: Qwen2Config
    eos_id: int
    sampling: SparkSampling = field(default_factory=SparkSampling)

    @property
    def num_speech_classes(self) -> int:
        """Width of a log-prob row: the whole LLM vocabulary (generated ids are LLM ids)."""
        return self.qwen.vocab_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)


@dataclass(frozen=True)
class SparkDecodeRequest(DecodeRequest):
    """A Spark request for ``BatchedDecoder``: ``text`` holds the whole prompt's ids (no separate prompt parts)."""

    @property
    def prefix_length(self) -> int:
        return len(self.text)


def spark_request(prompt_ids: Sequence[int], sampling: SparkSampling | None = None,
                  seed: int | None = None, ignore_eos: bool = False) -> SparkDecodeRequest:
    """``ignore_eos``: benchmark mode for random weights (never stops before ``max_new_tokens``)."""
    sampling = sampling or SparkSampling()
    params = SamplingParams(top_p=sampling.top_p, top_k=sampling.top_k, win_size=0, seed=seed,
                            min_tokens=0, max_tokens=sampling.max_new_tokens, ignore_eos=ignore_eos)
    return SparkDecodeRequest(text=tuple(int(i) for i in prompt_ids), sampling=params)


class SparkLM(SpeechLM):
    def __init__(self, config: SparkLMConfig) -> None:
        super().__init__()
        self.config = config
        self.llm = Qwen2ForCausalLM(config.qwen)

    @property
    def body(self) -> Qwen2Model:
        return self.llm.model

    @property
    def llm_decoder(self) -> nn.Linear:
        """The (tied) output head; the decoder reads its device from here."""
        return self.llm.lm_head

    def load_released(self, state: Mapping[str, torch.Tensor], tied: bool) -> None:
        """Load ``LLM/model.safetensors`` (already checked by ``spark_tts.loading``)."""
        state = dict(state)
        if tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        self.llm.load_state_dict(state, strict=True, assign=True)
        if tied:
            self.llm.lm_head.weight = self.llm.model.embed_tokens.weight

    def embed_prefix(self, text: Sequence[int] | torch.Tensor, prompt_text: Sequence[int] = (),
                     prompt_speech_tokens: Sequence[int] = ()) -> torch.Tensor:
        """``[1, L, hidden]``: embeddings of the prompt ids (``text``; Spark has no separate prompt parts)."""
        if len(prompt_text) or len(prompt_speech_tokens):
            raise ValueError("Spark prompts are a single id sequence")
        device = self.body.embed_tokens.weight.device
        return self.body.embed_tokens(torch.as_tensor(text, dtype=torch.long, device=device).reshape(1, -1))

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw logits over the vocabulary, fp32."""
        return self.llm.lm_head(hidden).float()

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (temperature, then top-k renormalised); see the module docstring."""
        s = self.config.sampling
        scaled = self.logits(hidden) / s.temperature
        kth = scaled.topk(min(s.top_k, scaled.shape[-1]), dim=-1).values[..., -1:]
        return F.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
