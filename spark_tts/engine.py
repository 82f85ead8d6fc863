"""``SparkTTS``: the whole engine for one process (audio tokenizer, LLM, vocoder), offline and streaming.

    engine = SparkTTS.load(model_dir, device="cuda")
    voice = engine.prepare_voices([wav_16k], ["its transcript"])[0]
    audio = engine.synthesize(voice, "Text to speak.", seed=1)            # float32, 16 kHz
    for piece in engine.stream(voice, "Text to speak.", seed=1): ...      # pieces concatenate to the same audio

A voice is small and integer-only (``SparkVoice``): 32 global tokens, the reference's semantic tokens and its
transcript, so it caches cheaply. Requests through ``synthesize``/``stream`` decode on a one-slot batched decoder;
a server drives ``speech_lm.decode.BatchedDecoder`` with ``spark_request`` for continuous batching.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from speech_lm.decode import generate_tokens
from spark_tts.audio_tokenizer import AudioTokenizer
from spark_tts.codec.bicodec import BiCodec
from spark_tts.errors import SparkInputError
from spark_tts.llm import SparkLM, SparkSampling, spark_request
from spark_tts.loading import check_model_dir, load_bicodec, load_llm, load_wav2vec2, read_audio_params
from spark_tts.prompt import SparkTokenizer
from spark_tts.streaming import ChunkSchedule, StreamVocoder, receptive_radius

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class SparkVoice:
    global_tokens: tuple[int, ...]
    semantic_tokens: tuple[int, ...]
    transcript: str | None  # None: transcript-free prompt (global tokens only)


class SparkTTS:
    sample_rate = SAMPLE_RATE

    def __init__(self, audio_tokenizer: AudioTokenizer, lm: SparkLM, tokenizer: SparkTokenizer,
                 bicodec: BiCodec) -> None:
        self.audio_tokenizer, self.lm, self.tokenizer, self.bicodec = audio_tokenizer, lm, tokenizer, bicodec
        self.radius = receptive_radius(bicodec.config)
        self.hop = bicodec.config.hop_length
        self._fixed_tokens: int | None = None

    def set_fixed_token_count(self, tokens: int | None) -> None:
        """Benchmark mode for random weights: every request generates exactly ``tokens`` LLM tokens (eos is never
        drawn) and every one of them counts as a semantic code (a random LLM mostly draws other ids; they are
        mapped to ``id % 8192``), so each request yields ``tokens`` codes. None restores the normal rules. Per
        request: the model itself is untouched."""
        self._fixed_tokens = tokens

    def codes_of(self, token: int) -> list[int]:
        """The semantic code(s) one generated LLM id contributes (benchmark mode: always one)."""
        if self._fixed_tokens is not None:
            return self.tokenizer.benchmark_codes([token])
        return self.tokenizer.semantic_codes([token])

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu", llm_dtype: torch.dtype = torch.float32,
             sampling: SparkSampling | None = None) -> "SparkTTS":
        """BiCodec and wav2vec2 run in fp32 (as trained); ``llm_dtype`` applies to the LLM only."""
        model_dir = Path(model_dir)
        check_model_dir(model_dir)
        bicodec = load_bicodec(model_dir, device)
        tokenizer = AudioTokenizer(bicodec, load_wav2vec2(model_dir, device), read_audio_params(model_dir))
        lm = load_llm(model_dir, device, llm_dtype, sampling)
        return cls(tokenizer, lm, SparkTokenizer.from_model_dir(model_dir), bicodec)

    def prepare_voices(self, wavs: Sequence[np.ndarray], transcripts: Sequence[str | None]) -> list[SparkVoice]:
        """16 kHz mono float waveforms (any lengths, tokenised as one masked batch) and their transcripts."""
        if len(wavs) != len(transcripts):
            raise SparkInputError("one transcript (or None) per waveform")
        tokens = self.audio_tokenizer.tokenize(list(wavs))
        return [SparkVoice(tuple(t.global_tokens.tolist()), tuple(t.semantic_tokens.tolist()), text)
                for t, text in zip(tokens, transcripts)]

    def prompt_ids(self, voice: SparkVoice, text: str) -> list[int]:
        semantic = voice.semantic_tokens if voice.transcript is not None else ()
        return self.tokenizer.prompt_ids(text, voice.global_tokens, voice.transcript, semantic)

    def generate(self, voice: SparkVoice, text: str, seed: int | None = None,
                 sampling: SparkSampling | None = None) -> Iterator[int]:
        """Semantic codes as the LLM samples them (non-semantic ids dropped). ``sampling`` overrides the top-k/p
        and length of this request; the temperature and top-k of the distribution are the model's."""
        sampling = sampling or self.lm.config.sampling
        if self._fixed_tokens is not None:
            sampling = replace(sampling, max_new_tokens=self._fixed_tokens)
        request = spark_request(self.prompt_ids(voice, text), sampling, seed, ignore_eos=self._fixed_tokens is not None)
        for token in generate_tokens(self.lm, request):
            yield from self.codes_of(token)

    @torch.inference_mode()
    def vocode(self, global_tokens: Sequence[int], semantic_tokens: Sequence[int]) -> np.ndarray:
        if not semantic_tokens:
            return np.zeros(0, dtype=np.float32)
        device = self.bicodec.quantizer.codebook.weight.device
        semantic = torch.tensor([list(semantic_tokens)], dtype=torch.long, device=device)
        global_ = torch.tensor([list(global_tokens)], dtype=torch.long, device=device)
        return self.bicodec.detokenize(semantic, global_)[0].float().cpu().numpy()

    @torch.inference_mode()
    def vocode_batch(self, items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """Several (global tokens, semantic tokens) of any lengths in one masked forward; each result equals
        ``vocode`` of that item alone (up to float rounding)."""
        items = [(g, s) for g, s in items]
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(items)
        rows = [i for i, (_, s) in enumerate(items) if len(s)]
        if not rows:
            return out
        device = self.bicodec.quantizer.codebook.weight.device
        lengths = torch.tensor([len(items[i][1]) for i in rows], device=device)
        semantic = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=device)
        for row, i in enumerate(rows):
            semantic[row, : len(items[i][1])] = torch.tensor(list(items[i][1]), dtype=torch.long)
        global_ = torch.tensor([list(items[i][0]) for i in rows], dtype=torch.long, device=device)
        waves = self.bicodec.detokenize(semantic, global_, lengths).float().cpu().numpy()
        for row, i in enumerate(rows):
            out[i] = waves[row, : len(items[i][1]) * self.hop]
        return out

    def synthesize(self, voice: SparkVoice, text: str, seed: int | None = None,
                   sampling: SparkSampling | None = None) -> np.ndarray:
        return self.vocode(voice.global_tokens, list(self.generate(voice, text, seed, sampling)))

    def stream_vocoder(self, voice: SparkVoice, schedule: ChunkSchedule = ChunkSchedule(),
                       right_context: int | None = None) -> StreamVocoder:
        return StreamVocoder(lambda tokens: self.vocode(voice.global_tokens, tokens), self.hop, self.radius,
                             schedule, right_context=right_context)

    def stream(self, voice: SparkVoice, text: str, seed: int | None = None,
               schedule: ChunkSchedule = ChunkSchedule(), sampling: SparkSampling | None = None
               ) -> Iterator[np.ndarray]:
        vocoder = self.stream_vocoder(voice, schedule)
        for code in self.generate(voice, text, seed, sampling):
            yield from vocoder.push([code])
        yield from vocoder.finish()
