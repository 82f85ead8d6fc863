"""CosyVoice2: zero-shot text-to-speech from a voice prompt, offline or streaming (docs/reference/cosyvoice2.md).

Per request: the text is normalized and split into segments (`speech_text`); each segment is synthesized
independently with the same prompt, in order: LLM speech tokens (`cosyvoice2.llm`), then flow + HiFT
(`cosyvoice2.streaming.Token2Wav`). Lower-level pieces (`speech_tokens`, `token2wav`, `open_stream`) are
public so that serving adapters can run the LLM and token2wav in separate processes/models.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

import numpy as np

from cosyvoice2.config import EngineConfig
from cosyvoice2.flow import CausalFlow
from cosyvoice2.frontend.llm_prompt import llm_prompt
from cosyvoice2.frontend.onnx_models import PromptModels
from cosyvoice2.frontend.prompt import VoicePrompt, build_voice_prompt
from cosyvoice2.hift import HiFTGenerator
from cosyvoice2.llm import CosyVoice2LM
from cosyvoice2.llm.request import CosyVoice2Sampling, cosyvoice2_request
from cosyvoice2.streaming import Token2Wav, Token2WavStream
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from speech_lm.decode import DecodeRequest, generate_tokens
from speech_text.segment import segment_text


class CosyVoice2:
    """The engine. Build it with `cosyvoice2.load(model_dir, device, dtype)`.

    Benchmark mode (`set_fixed_token_count`), for random-weight models that never stop sensibly: every text
    segment then generates exactly that many speech tokens (a per-request limit; the shared LLM is untouched).
    """

    def __init__(self, config: EngineConfig, llm: CosyVoice2LM, flow: CausalFlow, hift: HiFTGenerator,
                 tokenizer: CosyVoice2Tokenizer, prompt_models: PromptModels,
                 sampling: CosyVoice2Sampling = CosyVoice2Sampling()) -> None:
        self.config = config
        self.llm = llm
        self.tokenizer = tokenizer
        self.prompt_models = prompt_models
        self.sampling = sampling
        self.token2wav_engine = Token2Wav(flow, hift, config)
        self.fixed_token_count: int | None = None

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    # ---- prompt and text ---------------------------------------------------------------------------------
    def prepare_voice(self, wav: np.ndarray, sample_rate: int, transcript: str) -> VoicePrompt:
        """Reference recording (mono float in [-1, 1], >= 16 kHz, <= 30 s) + its transcript -> VoicePrompt."""
        return build_voice_prompt(wav, sample_rate, transcript, self.prompt_models)

    def segments(self, text: str) -> list[str]:
        """Normalized synthesis segments of `text` (upstream text_normalize(split=True))."""
        return segment_text(text, self.tokenizer.count)

    def set_fixed_token_count(self, count: int | None) -> None:
        """Benchmark mode on (count) or off (None) for the requests this pipeline builds from now on: they never
        draw a stop id and stop after `count` tokens (`CosyVoice2Sampling.ignore_eos`, `max_tokens`)."""
        if count is not None and count < 1:
            raise ValueError(f"fixed token count must be >= 1, got {count}")
        self.fixed_token_count = count

    # ---- LLM -------------------------------------------------------------------------------------------------
    def decode_request(self, segment: str, prompt: VoicePrompt, seed: int | None = None,
                       instruction: str = "") -> DecodeRequest:
        """The LLM request for one (already normalized) segment: zero-shot with the prompt's transcript,
        cross-lingual without one, instruct mode with an `instruction` (`cosyvoice2.frontend.llm_prompt`)."""
        text = self.tokenizer.encode(segment)
        mode_prompt = llm_prompt(prompt.transcript, instruction)
        sampling = replace(self.sampling, seed=seed)
        if self.fixed_token_count is not None:
            sampling = replace(sampling, max_tokens=self.fixed_token_count, ignore_eos=True)
        return cosyvoice2_request(
            text, self.tokenizer.encode(mode_prompt.text) if mode_prompt.text else [],
            prompt.speech_tokens.tolist() if mode_prompt.speech_tokens else [], sampling)

    def speech_tokens(self, segment: str, prompt: VoicePrompt, seed: int | None = None) -> Iterator[int]:
        """Speech tokens for one segment, yielded as the LLM decodes them."""
        return generate_tokens(self.llm, self.decode_request(segment, prompt, seed))

    # ---- token2wav -------------------------------------------------------------------------------------------
    def token2wav(self, tokens: Sequence[int], prompt: VoicePrompt, seed: int | None = None) -> np.ndarray:
        """All speech tokens of one segment -> float32 24 kHz audio, 960 samples per token."""
        engine = self.token2wav_engine
        return engine.offline(tokens, engine.flow_prompt(prompt), engine.new_generator(seed))

    def open_stream(self, prompt: VoicePrompt, seed: int | None = None,
                    first_hop: int | None = None) -> Token2WavStream:
        """A per-request streaming token2wav state: `push(tokens)` -> ready chunks, `finish()` -> last chunk."""
        engine = self.token2wav_engine
        return engine.open_stream(engine.flow_prompt(prompt), engine.new_generator(seed), first_hop)

    # ---- end to end ------------------------------------------------------------------------------------------
    def synthesize(self, text: str, prompt: VoicePrompt, seed: int | None = None) -> np.ndarray:
        """Whole utterance, float32 mono at `sample_rate`; segments are concatenated in order."""
        pieces = [self.token2wav(list(self.speech_tokens(segment, prompt, _segment_seed(seed, i))), prompt,
                                 _segment_seed(seed, i))
                  for i, segment in enumerate(self.segments(text))]
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    def stream(self, text: str, prompt: VoicePrompt, seed: int | None = None,
               first_hop: int | None = None) -> Iterator[np.ndarray]:
        """Audio chunks as soon as the chunk schedule allows (first chunk after 25 + pad + 3 tokens)."""
        for i, segment in enumerate(self.segments(text)):
            stream = self.open_stream(prompt, _segment_seed(seed, i), first_hop)
            for token in self.speech_tokens(segment, prompt, _segment_seed(seed, i)):
                yield from stream.push([token])
            yield stream.finish()


def _segment_seed(seed: int | None, index: int) -> int | None:
    """Distinct but reproducible seeds per segment of one request."""
    return None if seed is None else seed + index
