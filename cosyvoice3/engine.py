"""The CosyVoice3 engine: text + reference audio -> ids and voice -> speech tokens (LLM) -> audio (token2wav).

Build it with `cosyvoice3.load(model_dir, device, dtype)`. Two levels:

- text: `synthesize(text, reference_wav, reference_text, instruction, seed)` tokenizes (`cosyvoice3.text`), builds
  the voice from the reference recording (`cosyvoice3.frontend`) and picks the mode from the fields given;
- ids: `synthesize_ids(SynthesisRequest, VoicePrompt)` / `stream(...)` take token ids and a ready voice (what a
  serving layer that caches voices calls).

    engine = cosyvoice3.load(model_dir)
    audio = engine.synthesize("Hello.", "ref.wav", reference_text="What the reference says.")   # zero-shot
    voice = engine.prepare_voice(wav, sample_rate)
    for piece in engine.stream(engine.text_request("Hello.", instruction="Speak slowly."), voice): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from speech_lm.decode import DecodeRequest

from .config import CosyVoice3Config
from .errors import CosyVoice3InputError, CosyVoice3ModelError
from .flow import CosyVoice3Flow
from .hift import CausalHiFT
from .llm import CosyVoice3LM, LLMPrompt, Mode, generate
from .token2wav import CosyVoice3Stream, CosyVoice3Token2Wav, VoicePrompt

if TYPE_CHECKING:  # pragma: no cover - both import onnxruntime / transformers only when a model has their files
    from .frontend import PromptFrontend
    from .text import CosyVoice3Tokenizer

#: A reference recording: a file, or mono float samples with their rate.
ReferenceAudio = str | Path | tuple[np.ndarray, int]


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

    def __init__(self, config: CosyVoice3Config, llm: CosyVoice3LM, flow: CosyVoice3Flow, hift: CausalHiFT,
                 tokenizer: "CosyVoice3Tokenizer | None" = None,
                 prompt_frontend: "PromptFrontend | None" = None) -> None:
        self.config = config
        self.llm = llm
        self.token2wav_engine = CosyVoice3Token2Wav(flow, hift)
        self.fixed_token_count: int | None = None
        self._tokenizer = tokenizer
        self._prompt_frontend = prompt_frontend

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def set_fixed_token_count(self, count: int | None) -> None:
        if count is not None and count < 1:
            raise ValueError(f"fixed token count must be >= 1, got {count}")
        self.fixed_token_count = count

    # ---- text and voice ----------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> "CosyVoice3Tokenizer":
        if self._tokenizer is None:
            raise CosyVoice3ModelError("this engine has no text tokenizer (the model directory lacks the "
                                       "CosyVoice-BlankEN tokenizer files); use the id-level calls")
        return self._tokenizer

    @property
    def prompt_frontend(self) -> "PromptFrontend":
        if self._prompt_frontend is None:
            raise CosyVoice3ModelError("this engine has no prompt frontend (the model directory lacks "
                                       "campplus.onnx / speech_tokenizer_v3.onnx); pass a VoicePrompt")
        return self._prompt_frontend

    def prepare_voice(self, reference: ReferenceAudio | VoicePrompt) -> VoicePrompt:
        """A reference recording (a file or `(samples, sample_rate)`, >= 16 kHz, <= 30 s) -> VoicePrompt; a
        VoicePrompt passes through (voices are computed once and reused)."""
        if isinstance(reference, VoicePrompt):
            return reference
        if isinstance(reference, (str, Path)):
            return self.prompt_frontend.voice_from_file(reference)
        wav, sample_rate = reference
        return self.prompt_frontend.voice(wav, sample_rate)

    def text_request(self, text: str, reference_text: str | None = None, instruction: str | None = None,
                     seed: int | None = None) -> SynthesisRequest:
        """Ids of one request; the mode follows from the fields: an instruction -> instruct, a reference
        transcript -> zero_shot, neither -> cross_lingual (`cosyvoice3.text.request_mode`)."""
        from .text import prompt_ids, request_mode  # noqa: PLC0415 - transformers only for text-level calls

        if not text or not text.strip():
            raise CosyVoice3InputError("the text to synthesize is empty")
        mode = request_mode(reference_text, instruction)
        text_ids, prompt_text = prompt_ids(self.tokenizer, mode, text, reference_text, instruction)
        return SynthesisRequest(text=text_ids, prompt_text=prompt_text, mode=mode, seed=seed)

    # ---- LLM -------------------------------------------------------------------------------------------------
    def decode_request(self, request: SynthesisRequest, voice: VoicePrompt) -> DecodeRequest:
        prompt = LLMPrompt.build(request.mode, request.text, request.prompt_text, voice.tokens.tolist())
        limits = {} if self.fixed_token_count is None else {"max_tokens": self.fixed_token_count, "ignore_eos": True}
        decode = prompt.request(self.config.llm, request.seed, **limits)
        self.llm.check_text([*prompt.prompt_text, *prompt.text])  # a clear error before any decoding
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
    def synthesize(self, text: str, reference: ReferenceAudio | VoicePrompt, reference_text: str | None = None,
                   instruction: str | None = None, seed: int | None = None) -> np.ndarray:
        """Text + reference recording -> float32 mono audio at `sample_rate`, 960 samples per speech token.

        reference_text (the recording's transcript) selects zero-shot mode, instruction (speed, emotion, dialect
        ...) instruct mode, neither cross-lingual mode; the recording gives the voice in every mode. The text is
        synthesized as one piece (no normalisation or splitting)."""
        request = self.text_request(text, reference_text, instruction, seed)
        return self.synthesize_ids(request, self.prepare_voice(reference))

    def synthesize_ids(self, request: SynthesisRequest, voice: VoicePrompt) -> np.ndarray:
        """Ids + voice -> float32 mono audio at `sample_rate`, 960 samples per speech token."""
        return self.token2wav(list(self.speech_tokens(request, voice)), voice)

    def stream(self, request: SynthesisRequest, voice: VoicePrompt, cached: bool = False) -> Iterator[np.ndarray]:
        """Audio pieces as soon as the chunk schedule allows (the first after 15 + 3 tokens)."""
        stream = self.open_stream(voice, cached)
        for token in self.speech_tokens(request, voice):
            yield from stream.push([token])
        yield stream.finish()


__all__ = ["CosyVoice3", "SynthesisRequest", "VoicePrompt"]
