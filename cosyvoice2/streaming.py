"""Streaming token2wav: the chunk schedule and the per-stream state (spec §5).

Three layers, each with one job:

* `ChunkSchedule` is pure arithmetic: which token range each flow call covers. No torch, unit-testable.
* `Token2Wav` is stateless: tokens -> mel (flow) and mel -> audio (HiFT) for one prompt.
* `Token2WavStream` owns *all* mutable state of one stream (token buffer, schedule position, HiFT
  mel/source/speech caches, noise generator). Upstream keeps the hop length on the shared model object,
  so a second request starts with the grown hop; here nothing mutable is shared, so a server can keep one
  stream per request id and interleave them freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:  # torch stays out of the pure schedule's import path
    import torch

    from cosyvoice2.config import EngineConfig
    from cosyvoice2.frontend.prompt import VoicePrompt


@dataclass(frozen=True)
class Chunk:
    """One flow + HiFT call of a stream, in generated-token indices (prompt tokens not counted)."""

    start: int  # first token whose audio this chunk emits (upstream's token_offset)
    stop: int  # one past the last token whose audio this chunk emits
    feed: int  # the flow sees tokens[:feed]; feed - stop tokens are lookahead context only
    final: bool  # final chunk: full attention, lookahead padded, every remaining sample emitted

    @property
    def hop(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ChunkSchedule:
    """Upstream's chunk schedule: hop 25 + prompt pad, then x2 growth capped at 100, 3 lookahead tokens.

    The first hop is padded so that the first chunk boundary, counted from the start of the *prompt*
    tokens, lands on the flow's 25-token attention-chunk grid; later hops are multiples of it, so every
    non-final flow call ends on a chunk boundary and reproduces the frames of a longer call.
    """

    prompt_tokens: int = 0
    first_hop: int = 25
    grid: int = 25
    max_hop: int = 100
    growth: int = 2
    lookahead: int = 3

    def __post_init__(self) -> None:
        if self.first_hop < 4:
            # the HiFT cache withholds 8 mel frames = 4 tokens; a smaller first chunk has nothing to emit
            raise ValueError(f"first_hop must be >= 4 tokens, got {self.first_hop}")
        if self.prompt_tokens < 0 or self.grid < 1 or self.max_hop < self.first_hop or self.growth < 1:
            raise ValueError(f"inconsistent chunk schedule {self}")

    @property
    def prompt_pad(self) -> int:
        """Extra tokens in the first hop that align its end to the grid (0 when the prompt is aligned)."""
        return -self.prompt_tokens % self.grid

    def hop(self, index: int) -> int:
        """Tokens emitted by non-final chunk number `index` (0-based)."""
        base = min(self.max_hop, self.first_hop * self.growth**index)
        return base + (self.prompt_pad if index == 0 else 0)

    def next_chunk(self, start: int, index: int, available: int, finished: bool) -> Chunk | None:
        """The chunk to run now for a stream at (`start`, `index`) with `available` tokens, or None to wait.

        A non-final chunk runs as soon as its hop plus the lookahead is available (also after the LLM has
        finished); once the LLM has finished and that is no longer possible, the rest forms the final chunk.
        """
        hop = self.hop(index)
        if available - start >= hop + self.lookahead:
            return Chunk(start=start, stop=start + hop, feed=start + hop + self.lookahead, final=False)
        if finished:
            return Chunk(start=start, stop=available, feed=available, final=True)
        return None

    def chunks(self, n_tokens: int) -> list[Chunk]:
        """All chunks of a stream of `n_tokens` tokens (the same whether tokens arrive at once or one by one)."""
        out: list[Chunk] = []
        start = 0
        while True:
            chunk = self.next_chunk(start, len(out), n_tokens, finished=True)
            assert chunk is not None  # finished=True always yields a chunk
            out.append(chunk)
            if chunk.final:
                return out
            start = chunk.stop


# ---- token2wav ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlowPrompt:
    """A voice prompt's flow inputs as tensors on the flow's device (built once per stream/request)."""

    tokens: "torch.Tensor"  # (1, P) int64
    mel: "torch.Tensor"  # (1, 2P, 80) flow dtype, time-major
    xvector: "torch.Tensor"  # (1, 192) flow dtype

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])


@dataclass(frozen=True)
class HiFTCache:
    """What a non-final chunk leaves for the next one (upstream hift_cache_dict entry)."""

    mel: "torch.Tensor"  # (1, 80, mel_cache_len) last mel frames, re-vocoded by the next chunk
    source: "torch.Tensor"  # (1, 1, overlap) last source samples, forced into the next chunk's source
    speech: "torch.Tensor"  # (overlap,) withheld audio, cross-faded with the next chunk's first samples


class Token2Wav:
    """Stateless token -> audio conversion (flow + HiFT); one instance serves any number of streams.

    The flow runs in the model dtype; HiFT always runs in fp32 (as upstream). HiFT's source noise comes from
    the caller's `torch.Generator`, so a seeded request is reproducible whatever else runs.
    """

    def __init__(self, flow: "torch.nn.Module", hift: "torch.nn.Module", config: "EngineConfig") -> None:
        import torch

        self.flow = flow
        self.hift = hift
        self.config = config
        flow_weight = flow.input_embedding.weight
        self.flow_device, self.flow_dtype = flow_weight.device, flow_weight.dtype
        self.hift_device = hift.stft_window.device
        self.mel_cache_len = config.streaming.mel_cache_len
        self.overlap = self.mel_cache_len * config.hift.samples_per_frame  # 3840 samples
        # upstream: numpy's symmetric hamming(2 * overlap); rising half for the new chunk, falling for the old
        window = torch.from_numpy(np.hamming(2 * self.overlap).astype(np.float32)).to(self.hift_device)
        self.fade_in, self.fade_out = window[: self.overlap], window[self.overlap :]

    def flow_prompt(self, prompt: "VoicePrompt") -> FlowPrompt:
        import torch

        def tensor(array: np.ndarray, dtype: "torch.dtype") -> "torch.Tensor":
            return torch.as_tensor(array).to(self.flow_device, dtype).unsqueeze(0)

        return FlowPrompt(tensor(prompt.speech_tokens, torch.long), tensor(prompt.prompt_mel, self.flow_dtype),
                          tensor(prompt.xvector, self.flow_dtype))

    def new_generator(self, seed: int | None) -> "torch.Generator":
        import torch

        generator = torch.Generator(device=self.hift_device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator

    def mel(self, tokens: "Sequence[int] | torch.Tensor", prompt: FlowPrompt, start: int, final: bool) -> "torch.Tensor":
        """Mel (1, 80, frames) fp32 on the HiFT device for tokens[start:] of one flow call over tokens.

        Non-final calls use chunk attention and treat the last `pre_lookahead_len` tokens as context only;
        the final call uses full attention, as upstream (§3.7).
        """
        import torch

        token = torch.as_tensor(tokens, dtype=torch.long, device=self.flow_device).view(1, -1)
        mel = self.flow.inference(token, prompt.tokens, prompt.mel, prompt.xvector, streaming=not final,
                                  finalize=final)
        start_frame = start * self.config.flow.token_mel_ratio
        return mel[:, :, start_frame:].to(self.hift_device, torch.float32)

    def vocode(self, mel: "torch.Tensor", cache_source: "torch.Tensor | None",
               generator: "torch.Generator") -> "tuple[torch.Tensor, torch.Tensor]":
        """(1, 80, M) mel -> (audio (480 M,), source (1, 1, 480 M))."""
        audio, source = self.hift.inference(mel, cache_source=cache_source, generator=generator)
        return audio[0], source

    def offline(self, tokens: "Sequence[int]", prompt: FlowPrompt, generator: "torch.Generator") -> np.ndarray:
        """All tokens at once (upstream stream=False): 960 samples per token, float32 24 kHz."""
        import torch

        with torch.inference_mode():
            if len(tokens) == 0:
                return np.zeros(0, dtype=np.float32)
            audio, _ = self.vocode(self.mel(tokens, prompt, 0, final=True), None, generator)
            return audio.cpu().numpy()

    def open_stream(self, prompt: FlowPrompt, generator: "torch.Generator",
                    first_hop: int | None = None) -> "Token2WavStream":
        return Token2WavStream(self, prompt, self.config.schedule(prompt.num_tokens, first_hop), generator)


class Token2WavStream:
    """All state of one streaming request; feed tokens as the LLM emits them.

    Audio per chunk: a non-final chunk emits 2 x hop x 480 samples (the first one 3840 fewer, held back for
    the cross-fade), the final chunk emits the rest plus the held-back 3840, so a stream of N tokens yields
    exactly 960 N samples in total, like `Token2Wav.offline`.
    """

    def __init__(self, engine: Token2Wav, prompt: FlowPrompt, schedule: ChunkSchedule,
                 generator: "torch.Generator") -> None:
        self.engine = engine
        self.prompt = prompt
        self.schedule = schedule
        self.generator = generator
        self.tokens: list[int] = []
        self.chunks: list[Chunk] = []  # chunks run so far
        self._cache: HiFTCache | None = None
        self.finished = False

    @property
    def _start(self) -> int:
        return self.chunks[-1].stop if self.chunks else 0

    def push(self, tokens: Iterable[int]) -> list[np.ndarray]:
        """Add newly generated tokens; returns the audio chunks that became ready (possibly none)."""
        if self.finished:
            raise RuntimeError("push() after finish()")
        self.tokens.extend(int(t) for t in tokens)
        return self._drain(finished=False)

    def finish(self) -> np.ndarray:
        """The LLM is done: run what is left (final chunk, full attention) and return its audio."""
        if self.finished:
            raise RuntimeError("finish() called twice")
        pieces = self._drain(finished=True)
        self.finished = True
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

    def _drain(self, finished: bool) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        while (chunk := self.schedule.next_chunk(self._start, len(self.chunks), len(self.tokens), finished)):
            out.append(self._run(chunk))
            self.chunks.append(chunk)
            if chunk.final:
                break
        return out

    def _run(self, chunk: Chunk) -> np.ndarray:
        import torch

        engine = self.engine
        with torch.inference_mode():
            mel = engine.mel(self.tokens[: chunk.feed], self.prompt, chunk.start, chunk.final)
            cache = self._cache
            if cache is None and mel.shape[2] == 0:
                return np.zeros(0, dtype=np.float32)  # empty stream: nothing to vocode
            if cache is not None:
                mel = torch.cat([cache.mel, mel], dim=2)
            audio, source = engine.vocode(mel, cache.source if cache else None, self.generator)
            if cache is not None:
                faded = audio[: engine.overlap] * engine.fade_in + cache.speech * engine.fade_out
                audio = torch.cat([faded, audio[engine.overlap :]])
            if chunk.final:
                self._cache = None
            else:
                self._cache = HiFTCache(mel[:, :, -engine.mel_cache_len :], source[:, :, -engine.overlap :],
                                        audio[-engine.overlap :])
                audio = audio[: -engine.overlap]
            return audio.cpu().numpy()
