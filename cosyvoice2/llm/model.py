"""CosyVoice2LM: the Qwen2 body plus CosyVoice2's speech-token embedding and head (upstream ``Qwen2LM``).

State-dict keys equal ``llm.pt`` exactly: ``llm_embedding.weight`` (row 0 = SOS, row 1 = TASK_ID),
``llm.model.model.*`` / ``llm.model.lm_head.weight`` (the Qwen2 body; upstream nests ``Qwen2ForCausalLM`` as
``Qwen2Encoder.model``), ``speech_embedding.weight`` and ``llm_decoder.weight/bias`` (6561 speech ids + 3 end ids).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.llm.config import LLMConfig
from cosyvoice2.llm.request import CosyVoice2Prefix
from speech_lm.config import Qwen2Config
from speech_lm.qwen2 import Qwen2ForCausalLM, Qwen2Model, SpeechLM

SOS_INDEX = 0
TASK_ID_INDEX = 1


class Qwen2Encoder(nn.Module):
    """Holder that reproduces upstream's nesting (``llm.model`` is the ``Qwen2ForCausalLM``)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(config)


def _as_ids(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


class CosyVoice2LM(SpeechLM):
    def __init__(self, config: LLMConfig | None = None) -> None:
        super().__init__()
        self.config = config or LLMConfig()
        hidden = self.config.hidden_size
        self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = Qwen2Encoder(self.config.qwen)
        self.llm_decoder = nn.Linear(hidden, self.config.num_speech_classes)
        self.speech_embedding = nn.Embedding(self.config.num_speech_classes, hidden)

    @property
    def body(self) -> Qwen2Model:
        """The Qwen2 decoder stack (``llm.model.model``)."""
        return self.llm.model.model

    def embed_prefix(self, prefix: CosyVoice2Prefix) -> torch.Tensor:
        """``[1, 1 + Lp + Lt + 1 + P, hidden]`` = [SOS, embed(prompt_text ++ text), TASK_ID, embed(prompt speech)].

        The x-vector is not part of CosyVoice2's LLM input (upstream accepts and ignores it).
        """
        device = self.llm_embedding.weight.device
        text_ids = torch.cat([_as_ids(prefix.prompt_text, device), _as_ids(prefix.text, device)])
        parts = [
            self.llm_embedding.weight[SOS_INDEX : SOS_INDEX + 1],
            self.body.embed_tokens(text_ids),
            self.llm_embedding.weight[TASK_ID_INDEX : TASK_ID_INDEX + 1],
            self.speech_embedding(_as_ids(prefix.prompt_speech_tokens, device)),
        ]
        return torch.cat(parts, dim=0).unsqueeze(0)

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.speech_embedding(tokens)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """log_softmax over the 6564 speech classes, in fp32."""
        return F.log_softmax(self.llm_decoder(hidden).float(), dim=-1)
