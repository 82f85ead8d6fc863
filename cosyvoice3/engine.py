"""The CosyVoice3 engine: text ids + voice -> speech tokens (LLM) -> audio (token2wav), offline or streaming.

Build it with `cosyvoice3.load(model_dir, device, dtype)`. Inputs are token ids: the CosyVoice3 text tokenizer
(Qwen2 BPE plus CosyVoice3's special tokens) and the prompt-audio frontend (speech tokenizer v3, CAM++ x-vector,
24 kHz prompt mel) are separate steps; `VoicePrompt` holds their outputs.

    engine = cosyvoice3.load(model_dir)
    voice = VoicePrompt.from_arrays(prompt_tokens, prompt_mel, xvector)
    audio = engine.synthesize(SynthesisRequest(text=ids, prompt_text=prompt_ids), voice)   # zero-shot
    for piece in engine.stream(request, voice): ...                                     # streaming
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from cosyvoice2.llm.decode import DecodeRequest

from .config import CosyVoice3Config
from .flow import CosyVoice3Flow
from .hift import CausalHiFT
from .llm import CosyVoice3LM, LLMPrompt, Mode, generate
from .token2wav import CosyVoice3Stream, CosyVoice3Token2Wav, VoicePrompt


@dataclass(frozen=True)
class SynthesisRequest:
    """One utterance. `text`: target text ids (cross_lingual: the whole text, system prompt and
    `<|endofprompt|>` included). `prompt_text`: zero_shot: system prompt + `<|endofprompt|>` + transcript ids;
    instruct: system prompt + instruction + `<|endofprompt|>` ids (`cosyvoice3.llm` builds these texts)."""

    text: Sequence[int]
    prompt_text: Sequence[int] = ()
    mode: Mode = "zero_shot"
    seed: int | None = None


class CosyVoice3:
    """Benchmark mode (`set_fixed_token_count`): random-weight models never stop sensibly; every request then
    generates exactly that many speech tokens (no stop id is drawn)."""

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM, flow: CosyVoice3Flow, hift: CausalHiFT) -> None:
        self.config = config
        self.llm = llm
        self.token2wav_engine = CosyVoice3Token2Wav(flow, hift)
        self.fixed_token_count: int | None = None

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def set_fixed_token_count(self, count: int | None) -> None:
        if count is not None and count < 1:
            raise ValueError(f"fixed token count must be >= 1, got {count}")
        self.fixed_token_count = count

    # ---- LLM -------------------------------------------------------------------------------------------------
    def decode_request(self, request: SynthesisRequest, voice: VoicePrompt) -> DecodeRequest:
        prompt = LLMPrompt.build(request.mode, request.text, request.prompt_text, voice.tokens.tolist())
        limits = {} if self.fixed_token_count is None else {"max_tokens": self.fixed_token_count, "ignore_eos": True}
        decode = prompt.request(self.config.llm, request.seed, **limits)
        self.llm.check_text([*decode.prompt_text, *decode.text])  # a clear error before any decoding
        return decode

    def speech_tokens(self, request: SynthesisRequest, voice: VoicePrompt) -> Iterator[int]:
        """Speech tokens as the LLM decodes them, runs of silent tokens beyond 5 dropped."""
        return generate(self.llm, self.decode_request(request, voice))

    # ---- token2wav -------------------------------------------------------------------------------------------
    def token2wav(self, tokens: Sequence[int], voice: VoicePrompt) -> np.ndarray:
        return self.token2wav_engine.offline(tokens, voice)

    def open_stream(self, voice: VoicePrompt, cached: bool = False) -> CosyVoice3Stream:
        return self.token2wav_engine.open_stream(voice, cached)

    # ---- end to end ------------------------------------------------------------------------------------------
    def synthesize(self, request: SynthesisRequest, voice: VoicePrompt) -> np.ndarray:
        """Float32 mono audio at `sample_rate`, 960 samples per speech token."""
        return self.token2wav(list(self.speech_tokens(request, voice)), voice)

    def stream(self, request: SynthesisRequest, voice: VoicePrompt, cached: bool = False) -> Iterator[np.ndarray]:
        """Audio pieces as soon as the chunk schedule allows (the first after 15 + 3 tokens)."""
        stream = self.open_stream(voice, cached)
        for token in self.speech_tokens(request, voice):
            yield from stream.push([token])
        yield stream.finish()


__all__ = ["CosyVoice3", "SynthesisRequest", "VoicePrompt"]
