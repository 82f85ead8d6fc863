"""The Spark LLM (Qwen2.5-0.5B with Spark's added tokens) on the speech-LM runtime's batched decoder.

``SparkLM`` wraps the runtime's Qwen2 body (``speech_lm.qwen2``) and presents the interface that
``speech_lm.decode.BatchedDecoder`` drives (prefix embedding, token embedding, log-probs, vocabulary, KV cache),
so Spark requests get the same static KV cache, CUDA graphs and continuous batching as the CosyVoice models'.
A Spark prefix is the prompt's LLM ids as they are (``SparkTokenizer.prompt_ids``), embedded by the text
embedding; generated ids are fed back the same way:

    decoder = BatchedDecoder(spark_lm, num_slots=16, max_seq_len=2048)
    slot = decoder.add(spark_request(prompt_ids, seed=7))
    ... decoder.step() ...   # generated ids are LLM ids; SparkTokenizer.semantic_codes maps them to codes

Sampling (the served runtime's request: temperature 0.8, top-k 50, top-p 0.95, no repetition penalty, stop at
``<|im_end|>``, at most 512 new tokens): ``log_probs`` divides the logits by the temperature and keeps the top-k
(ties at the k-th value kept), renormalised; the decoder's nucleus draw then keeps, from the most probable
down, every id whose preceding mass is below top-p. That is top-k then top-p over the renormalised top-k, as
Hugging Face's and TensorRT-LLM's samplers apply them. Repetition-aware resampling is not used (the decoder's
``SamplingParams.repetition`` stays unset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speech_lm.config import OutputVocabulary, Qwen2Config
from speech_lm.decode import DecodeRequest
from speech_lm.qwen2 import Qwen2ForCausalLM, Qwen2Model, SpeechLM
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
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def vocabulary(self) -> OutputVocabulary:
        """Log-prob rows span the whole LLM vocabulary (generated ids are LLM ids); ``<|im_end|>`` stops. No
        minimum length (requests set ``min_tokens`` 0)."""
        return OutputVocabulary(self.qwen.vocab_size, self.stop_ids, masked_below_min=self.eos_id)


def spark_request(prompt_ids: Sequence[int], sampling: SparkSampling | None = None,
                  seed: int | None = None, ignore_eos: bool = False) -> DecodeRequest:
    """The decoder's request for one prompt: its LLM ids are the prefix, up to ``max_new_tokens`` new ids.
    ``ignore_eos``: benchmark mode for random weights (never stops before ``max_new_tokens``)."""
    sampling = sampling or SparkSampling()
    params = SamplingParams(top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)
    return DecodeRequest(tuple(int(i) for i in prompt_ids), params, max_tokens=sampling.max_new_tokens,
                         min_tokens=0, ignore_eos=ignore_eos)


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

    def embed_prefix(self, prompt_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``[1, L, hidden]``: embeddings of the prompt's LLM ids (Spark's whole prefix)."""
        device = self.body.embed_tokens.weight.device
        return self.body.embed_tokens(torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1))

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
