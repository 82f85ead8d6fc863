"""CosyVoice3LM on the runtime's batched decoder (`speech_lm.decode`), its prompt formats and the silent-token
filter.

The model is the runtime's Qwen2 body (`speech_lm.qwen2`, nested as CosyVoice2 nests it) with a different speech
vocabulary: 6561 speech
tokens plus 200 special ids (sos 6561, eos 6562, task 6563, fill 6564, the rest unused) in one
`speech_embedding` and one bias-free `llm_decoder`. The LLM input is

    [S[sos], E(prompt_text ++ text), S[task], S(prompt speech tokens)]

with E the Qwen2 text embedding and S the speech embedding; no speaker embedding enters the LLM. Every text
(prompt text ++ text) must contain `<|endofprompt|>`, which separates the system prompt / instruction from what
is spoken; `zero_shot_prompt`, `instruct_prompt` and `cross_lingual_text` (`cosyvoice3.prompts`, torch-free)
build the three formats.

Decoding runs on `BatchedDecoder` / `generate_tokens`: the prefix is an `LLMPrompt`; the vocabulary
(`CosyVoice3LLMConfig.vocabulary`) lists all 200 special ids as stop ids (any of them ends a request and is never
emitted) and masks 6561 below the minimum length, which is exactly what the reference does (it masks index
`speech_token_size`, sos in this vocabulary, not eos). Sampling and limits follow CosyVoice2's rules
(`cosyvoice2.llm.request`) with the released values: RAS over top-p 0.8 / top-k 25, min 2x and max 20x the target
text ids (the prompt text not counted).

After decoding, `SilentTokenFilter` drops every silent/breath token beyond 5 in a row, as the reference's
synthesis loop does for CosyVoice3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.llm.model import Qwen2Encoder
from cosyvoice2.llm.request import CosyVoice2Prefix, CosyVoice2Sampling, decode_request
from speech_lm.decode import DecodeRequest, generate_tokens
from speech_lm.qwen2 import Qwen2Model, SpeechLM

from .config import ENDOFPROMPT, CosyVoice3LLMConfig
from .errors import CosyVoice3InputError
from .prompts import Mode, cross_lingual_text, instruct_prompt, zero_shot_prompt  # noqa: F401 - the LLM's formats
from .silence import SilentTokenFilter


class CosyVoice3LM(SpeechLM):
    """State-dict keys equal the released `llm.pt`: `llm.model.model.*`, `llm.model.lm_head.weight` (tied to the
    text embedding), `speech_embedding.weight`, `llm_decoder.weight` (no bias)."""

    def __init__(self, config: CosyVoice3LLMConfig | None = None) -> None:
        super().__init__()
        self.config = config or CosyVoice3LLMConfig()
        hidden = self.config.hidden_size
        self.llm = Qwen2Encoder(self.config.qwen)
        self.llm_decoder = nn.Linear(hidden, self.config.num_speech_classes, bias=False)
        self.speech_embedding = nn.Embedding(self.config.num_speech_classes, hidden)

    @property
    def body(self) -> Qwen2Model:
        return self.llm.model.model

    def check_text(self, text_ids: Sequence[int]) -> None:
        vocab = self.config.qwen.vocab_size
        bad = [i for i in text_ids if not 0 <= i < vocab]
        if bad:
            raise CosyVoice3InputError(f"text ids {bad[:5]} are outside the text vocabulary (0..{vocab - 1})")
        if self.config.endofprompt_id not in text_ids:
            raise CosyVoice3InputError(
                f"a CosyVoice3 text must contain {ENDOFPROMPT} (id {self.config.endofprompt_id}) in its prompt text "
                "or text (see zero_shot_prompt / instruct_prompt / cross_lingual_text)")

    def embed_prefix(self, prompt: "LLMPrompt") -> torch.Tensor:
        """`[1, 1 + Lp + Lt + 1 + P, hidden]` = [S[sos], E(prompt_text ++ text), S[task], S(prompt speech)]."""
        device = self.speech_embedding.weight.device
        text_ids = [*prompt.prompt_text, *prompt.text]
        self.check_text(text_ids)
        speech = list(prompt.prompt_speech_tokens)
        if any(not 0 <= t < self.config.speech_token_size for t in speech):
            raise CosyVoice3InputError(f"prompt speech tokens must lie in 0..{self.config.speech_token_size - 1}")
        special = torch.tensor([self.config.sos_id, self.config.task_id], device=device)
        sos, task = self.speech_embedding(special).split(1)
        parts = [sos, self.body.embed_tokens(torch.tensor(text_ids, dtype=torch.long, device=device)), task,
                 self.speech_embedding(torch.tensor(speech, dtype=torch.long, device=device))]
        return torch.cat(parts, dim=0).unsqueeze(0)

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.speech_embedding(tokens)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """log_softmax over the 6761 speech classes, in fp32."""
        return F.log_softmax(self.llm_decoder(hidden).float(), dim=-1)


def sampling_params(config: CosyVoice3LLMConfig, seed: int | None = None,
                    **limits: int | bool | None) -> CosyVoice2Sampling:
    """The released sampler (RAS over top-p 0.8 / top-k 25, window 10, tau 0.1) with a per-request seed.
    `limits`: `min_tokens` / `max_tokens` / `ignore_eos` of `CosyVoice2Sampling` (unset: 2x / 20x the text ids)."""
    s = config.sampling
    return CosyVoice2Sampling(top_p=s.top_p, top_k=s.top_k, win_size=s.win_size, tau_r=s.tau_r, seed=seed,
                              **limits)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LLMPrompt(CosyVoice2Prefix):
    """The token ids of one request's LLM input, by mode (see the module docstring): the decoder's prefix, which
    `CosyVoice3LM.embed_prefix` embeds. CosyVoice2's layout (text, prompt text, prompt speech between a start and
    a task row), with CosyVoice3's special rows."""

    @classmethod
    def build(cls, mode: Mode, text: Sequence[int], prompt_text: Sequence[int] = (),
              prompt_speech_tokens: Sequence[int] = ()) -> "LLMPrompt":
        """zero_shot: prompt text (system prompt + endofprompt + transcript) and prompt speech; instruct: the
        instruction prompt text, prompt speech dropped; cross_lingual: the text alone (it carries the system
        prompt), prompt text and prompt speech dropped."""
        ids = tuple(int(i) for i in text)
        if mode == "zero_shot":
            return cls(ids, tuple(int(i) for i in prompt_text), tuple(int(i) for i in prompt_speech_tokens))
        if mode == "instruct":
            return cls(ids, tuple(int(i) for i in prompt_text))
        if mode == "cross_lingual":
            return cls(ids)
        raise CosyVoice3InputError(f"unknown mode {mode!r} (zero_shot, cross_lingual or instruct)")

    def request(self, config: CosyVoice3LLMConfig, seed: int | None = None, **limits: int | bool | None) -> DecodeRequest:
        """The decoder's request: this prompt as the prefix, the limits scaled by the target text ids."""
        return decode_request(self, len(self.text), sampling_params(config, seed, **limits))


def generate(model: CosyVoice3LM, request: DecodeRequest, filter_silence: bool = True) -> Iterator[int]:
    """One request's speech tokens as they are decoded, silent runs filtered (a one-slot `BatchedDecoder`)."""
    tokens = generate_tokens(model, request)
    return SilentTokenFilter.for_config(model.config).filter(tokens) if filter_silence else tokens
