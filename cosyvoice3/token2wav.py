"""CosyVoice3 token2wav: speech tokens + voice prompt -> 24 kHz audio, offline and streaming.

Offline: one flow call over prompt + all tokens (full attention), one vocoder call.

Streaming follows the served runtime's schedule and arithmetic (`CosyVoice3Streaming`): chunks of 15 tokens,
then 25, 50, 100, 200, ... (doubling without a cap), each non-final chunk carrying 3 more tokens as lookahead
context; the rest forms the final chunk. Chunk k runs the flow over prompt + every token so far with the chunked
attention mask (non-final) or full attention (final), keeps the mel of its own tokens, appends it to the stream's
mel, vocodes the whole accumulated mel (causal HiFT, `finalize` only on the final chunk) and emits the samples
beyond those already sent. A stream of N tokens emits exactly 960 N samples.

Two flow paths, the same numbers up to float rounding:
- recompute (the reference): every chunk re-runs prompt + tokens from scratch;
- cached (`cached=True`): per stream, per Euler step and per DiT block, the attention keys/values of every frame in
  a complete 50-frame chunk are kept, with the ODE state of the frames the conv position embedding still needs.
  Under the chunk mask such frames never see a later frame, and their inputs (tokens with their real lookahead,
  prompt mel, noise) never change, so their values are final: a chunk only computes the frames from the last
  complete chunk on. The final chunk (full attention) is always recomputed, as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from cosyvoice2.dit.token2wav import DiTChunkSchedule, DiTStreamingConfig, VoiceCaches, prompt_key
from cosyvoice2.streaming import Chunk, ChunkedStream

from .errors import CosyVoice3InputError
from .flow import CosyVoice3Flow, FlowInputs
from .hift import CausalHiFT

#: Doubling hops without a cap: `max_hop` only has to exceed any stream's length.
_UNCAPPED = 1 << 30


def runtime_schedule(first_hop: int = 15, second_hop: int = 25, lookahead: int = 3) -> DiTChunkSchedule:
    """The served runtime's exponential schedule: `first_hop`, then `second_hop` doubling per chunk, no cap."""
    config = DiTStreamingConfig(first_hops=(first_hop, second_hop), growth=2, max_hop=_UNCAPPED)
    return DiTChunkSchedule(config, lookahead)


@dataclass(frozen=True)
class VoicePrompt:
    """A voice for token2wav: prompt speech tokens (P,), prompt mel (2P, 80) (frames, bins) and x-vector (192,)."""

    tokens: torch.Tensor
    mel: torch.Tensor
    xvector: torch.Tensor

    @classmethod
    def from_arrays(cls, tokens: Sequence[int] | np.ndarray, mel: np.ndarray | torch.Tensor,
                    xvector: np.ndarray | torch.Tensor) -> "VoicePrompt":
        mel_t = torch.as_tensor(np.asarray(mel, dtype=np.float32)).reshape(-1, np.shape(mel)[-1])
        return cls(torch.as_tensor(np.asarray(tokens, dtype=np.int64)).reshape(-1), mel_t,
                   torch.as_tensor(np.asarray(xvector, dtype=np.float32)).reshape(-1))


@dataclass
class FlowCache:
    """One stream's exact flow caches (see the module docstring). `committed` frames (from the first prompt
    frame) are final; kv[step][block] = (keys, values), each (2, H, committed, dim_head) for the conditional and
    unconditional rows; context[step] = the ODE state entering that step for the `committed` frames' last
    `context` frames (what the causal conv position embedding of later frames reads)."""

    committed: int = 0
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    context: list[torch.Tensor] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for step in self.kv for k, v in step) + sum(c.nbytes for c in self.context)


def cached_solve(flow: CosyVoice3Flow, inputs: FlowInputs, cache: FlowCache) -> tuple[torch.Tensor, FlowCache]:
    """Streaming-mask Euler solve of frames [cache.committed, T) over the cache -> (mel of those frames
    (1, 80, T - committed), the cache extended to every complete chunk of this call)."""
    estimator, cfm = flow.estimator, flow.decoder
    start, total = cache.committed, inputs.frames
    receptive = estimator.input_embed.conv_pos_embed.receptive_field
    context = min(start, receptive)
    rate = cfm.config.inference_cfg_rate
    mu, cond = inputs.mu[:, :, start - context:], inputs.cond[:, :, start - context:]
    mu_in, cond_in = torch.cat([mu, torch.zeros_like(mu)]), torch.cat([cond, torch.zeros_like(cond)])
    spks_in = torch.cat([inputs.spks, torch.zeros_like(inputs.spks)])
    x = cfm.rand_noise[:, :, start:total].to(mu)
    chunk = estimator.config.static_chunk_size
    commit = max(start, total // chunk * chunk)
    kept = min(commit, receptive)
    new = FlowCache(commit)
    for step, (t, dt) in enumerate(cfm.schedule):
        window = torch.cat([cache.context[step], x], dim=2) if context else x  # frames [start - context, T)
        t_in = torch.full((2,), t, dtype=mu.dtype, device=mu.device)
        past = cache.kv[step] if cache.kv else [None] * len(estimator.transformer_blocks)
        velocity, own = estimator.forward_window(torch.cat([window, window]), mu_in, t_in, spks_in, cond_in,
                                                 start, past)  # type: ignore[arg-type]
        x = x + dt * ((1.0 + rate) * velocity[:1] - rate * velocity[1:])
        new.kv.append([_extend(p, k, v, commit - start) for p, (k, v) in zip(past, own)])
        offset = commit - kept - (start - context)  # where the kept context starts inside `window`
        new.context.append(window[:, :, offset:offset + kept].clone())
    return x.float(), new


def _extend(past: Optional[tuple[torch.Tensor, torch.Tensor]], keys: torch.Tensor, values: torch.Tensor,
            keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """past ++ the first `keep` new frames, as new tensors (caches are shared read-only, never written); the new
    frames are copied so the call's whole key/value tensors are not kept alive by a slice."""
    if past is None:
        return keys[:, :, :keep].clone(), values[:, :, :keep].clone()
    if keep == 0:
        return past
    return torch.cat([past[0], keys[:, :, :keep]], dim=2), torch.cat([past[1], values[:, :, :keep]], dim=2)


@dataclass(frozen=True)
class PendingChunk:
    """A computed chunk not yet applied to its stream (`CosyVoice3Stream.prepare` / `commit`)."""

    stream: "CosyVoice3Stream"
    chunk: Chunk
    mel: Optional[torch.Tensor]
    cache: Optional[FlowCache]
    audio: np.ndarray


class CosyVoice3Token2Wav:
    """Flow + causal HiFT; offline synthesis and streams."""

    def __init__(self, flow: CosyVoice3Flow, hift: CausalHiFT, schedule: Optional[DiTChunkSchedule] = None,
                 voice_capacity: int = 8) -> None:
        """voice_capacity: voices whose prompt flow cache (`prompt_flow_cache`) is kept for cached streams, least
        recently used dropped first (each holds its committed prompt frames' keys/values: see docs)."""
        self.flow = flow
        self.hift = hift
        self.voice_caches = VoiceCaches(voice_capacity)
        self.schedule = schedule or runtime_schedule(lookahead=flow.config.pre_lookahead_len)
        self.lookahead = flow.config.pre_lookahead_len
        weight = flow.input_embedding.weight
        self.flow_device, self.flow_dtype = weight.device, weight.dtype
        self.hift_device = hift.stft_window.device

    @property
    def sample_rate(self) -> int:
        return self.hift.config.sampling_rate

    @property
    def samples_per_token(self) -> int:
        return self.flow.config.token_mel_ratio * self.hift.config.samples_per_frame

    # ---- pieces -----------------------------------------------------------------------------------------
    def flow_inputs(self, tokens: Sequence[int], prompt: VoicePrompt, finalize: bool) -> FlowInputs:
        return self.flow.inputs(tokens, prompt.tokens, prompt.mel.unsqueeze(0).to(self.flow_device, self.flow_dtype),
                                prompt.xvector.unsqueeze(0).to(self.flow_device), finalize)

    def mel(self, tokens: Sequence[int], prompt: VoicePrompt, streaming: bool = False,
            finalize: bool = True) -> torch.Tensor:
        """The flow's target mel (1, 80, frames) float32 (recompute path)."""
        return self.flow.inference(tokens, prompt.tokens, prompt.mel.unsqueeze(0).to(self.flow_device,
                                                                                     self.flow_dtype),
                                   prompt.xvector.unsqueeze(0).to(self.flow_device), streaming, finalize)

    def vocode(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """(1, 80, M) -> (samples,) float32 on the CPU."""
        audio, _ = self.hift.inference(mel.to(self.hift_device, torch.float32), finalize)
        return audio[0].cpu()

    # ---- offline ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def offline(self, tokens: Sequence[int], prompt: VoicePrompt) -> np.ndarray:
        """960 samples per token (float32); no tokens, no audio."""
        if len(tokens) == 0:
            return np.zeros(0, dtype=np.float32)
        return self.vocode(self.mel(tokens, prompt)).numpy()

    # ---- streaming --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prompt_flow_cache(self, prompt: VoicePrompt) -> FlowCache:
        """The flow cache every cached stream of this voice starts from: the complete 50-frame chunks among the
        frames that depend on the prompt alone (each prompt token's features read the 3 tokens after it, so the
        last 3 prompt tokens' frames wait for the stream's own tokens). Computed once per voice; streams never
        modify it (a chunk builds a new cache)."""
        if prompt.tokens.numel() <= self.lookahead:
            return FlowCache()
        key = prompt_key(prompt.tokens.cpu().numpy(), prompt.mel.cpu().numpy(), prompt.xvector.cpu().numpy())

        def compute() -> FlowCache:
            inputs = self.flow.inputs([], prompt.tokens, prompt.mel.unsqueeze(0).to(self.flow_device, self.flow_dtype),
                                      prompt.xvector.unsqueeze(0).to(self.flow_device), finalize=False)
            return cached_solve(self.flow, inputs, FlowCache())[1]

        return self.voice_caches.get(key, compute)  # type: ignore[arg-type, return-value]

    def open_stream(self, prompt: VoicePrompt, cached: bool = False) -> "CosyVoice3Stream":
        """cached: run non-final chunks over flow caches, starting from the voice's `prompt_flow_cache`."""
        return CosyVoice3Stream(self, prompt, self.prompt_flow_cache(prompt) if cached else None)

    @torch.inference_mode()
    def run_chunks(self, work: Sequence[tuple["CosyVoice3Stream", Chunk]]) -> list[np.ndarray]:
        """Run the next chunk of each stream (one after another) and return each one's new audio. All or
        nothing: the chunks are computed first and applied only when every one succeeded, so a call that raises
        leaves every stream as it was (a caller may retry each job alone)."""
        pending = [stream.prepare(chunk) for stream, chunk in work]
        return [p.stream.commit(p) for p in pending]

    def offline_job(self, tokens: Sequence[int], prompt: VoicePrompt) -> tuple["CosyVoice3Stream", Chunk]:
        """A whole utterance as a one-chunk stream (a final chunk over all tokens: full attention, final vocoder
        call, the same audio as `offline`), to run in `run_chunks` beside streaming chunks."""
        stream = self.open_stream(prompt)
        stream.extend(tokens)
        return stream, Chunk(0, len(stream.tokens), len(stream.tokens), final=True)


class CosyVoice3Stream(ChunkedStream):
    """All state of one stream: tokens, chunks run, the accumulated mel, samples sent, the optional flow cache.
    `extend` / `next_chunk` / `push` / `finish` as CosyVoice2's streams (`cosyvoice2.streaming.ChunkedStream`)."""

    def __init__(self, engine: CosyVoice3Token2Wav, prompt: VoicePrompt, flow_cache: Optional[FlowCache] = None) -> None:
        """flow_cache: where the cached flow path starts (None: every chunk recomputes, the reference path)."""
        self.engine = engine
        self.prompt = prompt
        self.schedule = engine.schedule
        self.tokens: list[int] = []
        self.chunks: list[Chunk] = []
        self.finished = False
        self.cached = flow_cache is not None
        self.flow_cache = flow_cache
        self._mels: list[torch.Tensor] = []
        self._sent = 0

    def check_next(self, chunk: Chunk) -> None:
        if self.finished:
            raise RuntimeError("the stream already ran its final chunk")
        if chunk.start != self._start or not chunk.start <= chunk.stop <= chunk.feed <= len(self.tokens):
            raise CosyVoice3InputError(f"{chunk} does not continue the stream (at token {self._start} of "
                                       f"{len(self.tokens)})")
        if not chunk.final and chunk.feed - chunk.stop != self.engine.lookahead:
            raise CosyVoice3InputError(f"a non-final chunk carries exactly {self.engine.lookahead} lookahead tokens")

    def chunk_mel(self, chunk: Chunk) -> tuple[torch.Tensor, Optional[FlowCache]]:
        """The mel frames of tokens [start, stop) (final: [start, end)) of this chunk, (1, 80, frames), and the
        flow cache after it (None without one). Changes nothing in the stream."""
        engine, ratio = self.engine, self.engine.flow.config.token_mel_ratio
        tokens = self.tokens[: chunk.feed]
        if chunk.final or self.flow_cache is None:  # the final chunk has full attention: nothing carries over
            mel = engine.mel(tokens, self.prompt, streaming=not chunk.final, finalize=chunk.final)
            return mel[:, :, ratio * chunk.start:], None
        inputs = engine.flow_inputs(tokens, self.prompt, finalize=False)
        solved_from = self.flow_cache.committed  # the solve returns frames [solved_from, T), prompt frames counted
        mel, cache = cached_solve(engine.flow, inputs, self.flow_cache)
        return mel[:, :, inputs.prompt_frames + ratio * chunk.start - solved_from:], cache

    def prepare(self, chunk: Chunk) -> "PendingChunk":
        """Compute `chunk` (the schedule's next one) without changing the stream; `commit` applies it."""
        self.check_next(chunk)
        if not self.tokens:  # an empty stream: nothing to vocode
            return PendingChunk(self, chunk, None, None, np.zeros(0, dtype=np.float32))
        mel, cache = self.chunk_mel(chunk)
        mel = mel.to(self.engine.hift_device, torch.float32)
        audio = self.engine.vocode(torch.cat([*self._mels, mel], dim=2), finalize=chunk.final)
        return PendingChunk(self, chunk, mel, cache, audio[self._sent:].numpy())

    def commit(self, pending: "PendingChunk") -> np.ndarray:
        if pending.mel is not None:
            self._mels.append(pending.mel)
        self._sent += pending.audio.shape[0]
        self.flow_cache = None if pending.chunk.final or pending.cache is None else pending.cache
        self.chunks.append(pending.chunk)
        self.finished = pending.chunk.final
        return pending.audio

    @torch.inference_mode()
    def run(self, chunk: Chunk) -> np.ndarray:
        """Run `chunk` (the schedule's next one) and return its new audio; if it raises, the stream is unchanged."""
        return self.commit(self.prepare(chunk))

    def audio(self, tokens: Iterable[int]) -> np.ndarray:
        """Convenience: push all `tokens`, finish, and return the whole stream's audio."""
        pieces = self.push(tokens)
        pieces.append(self.finish())
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
