"""DiT token2wav: offline synthesis and streams with real per-stream caches (flow caches + HiFT caches).

* `PromptCache` (flow.py) is computed once per voice by `DiTToken2Wav.prompt_cache` and shared, read-only, by
  every stream of that voice (`VoiceCaches` keeps them per voice key).
* `DiTStream` holds *all* mutable state of one stream: its tokens, schedule position, flow state (encoder and
  per-ODE-step estimator caches) and HiFT caches (last mel frames, last source samples, withheld audio), plus its
  noise generator. Its API has the shape of the UNet flow's stream (`extend` / `next_chunk` / `push` /
  `finish`, and `DiTToken2Wav.run_chunks` to run the next chunk of several streams together), so a server
  drives either the same way.

Per chunk the flow costs the same however long the stream already is: the encoder attends to its cached K/V, the
estimator to a K/V window of prompt + 100 frames per ODE step (see docs/engine.md, "DiT token2wav").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from cosyvoice2.hift import HiFTGenerator
from cosyvoice2.host_copies import to_host
from cosyvoice2.streaming import (  # the same chunk, HiFT state and cross-fade as the UNet path
    Chunk, ChunkedStream, FlowAndVocoder, HiFTCache,
)

from .flow import DiTFlow, FlowState, PromptCache
from .graphs import DiTGraphBuckets, DiTStepGraphs, HopSchedule, max_prompt_frames


@dataclass(frozen=True)
class DiTStreamingConfig:
    """Chunk schedule and HiFT overlap of DiT streams.

    Hops (tokens whose audio a non-final chunk emits): `first_hops`, then the last of them times `growth` per
    chunk, capped at `max_hop` (15, 25, 50, 100, 100, ...). Every non-final chunk also sends `lookahead` more
    tokens as context (they are sent again as ordinary tokens with the next chunk).
    """

    first_hops: tuple[int, ...] = (15, 25)
    growth: int = 2
    max_hop: int = 100
    mel_cache_len: int = 8  # mel frames HiFT re-vocodes at the start of the next chunk

    def __post_init__(self) -> None:
        if not self.first_hops or min(self.first_hops) < 4:
            # a chunk withholds mel_cache_len (8) mel frames = 4 tokens of audio; a smaller hop has nothing to emit
            raise ValueError(f"hops must be >= 4 tokens, got {self.first_hops}")
        if self.growth < 1 or self.max_hop < max(self.first_hops):
            raise ValueError(f"inconsistent DiT chunk schedule {self}")

    def hop(self, index: int) -> int:
        if index < len(self.first_hops):
            return self.first_hops[index]
        return min(self.max_hop, self.first_hops[-1] * self.growth ** (index - len(self.first_hops) + 1))


@dataclass(frozen=True)
class DiTChunkSchedule:
    """Which token range each chunk of a stream covers (pure arithmetic; the same calls as the UNet flow's
    `ChunkSchedule`, so a server's chunking loop can drive either)."""

    config: DiTStreamingConfig = DiTStreamingConfig()
    lookahead: int = 3

    def hop(self, index: int) -> int:
        return self.config.hop(index)

    def next_chunk(self, start: int, index: int, available: int, finished: bool) -> Optional["Chunk"]:
        """The chunk to run now for a stream at token `start` after `index` chunks, with `available` tokens, or
        None to wait. A non-final chunk runs once its hop plus the lookahead is there; once the LLM is done
        (`finished`) and that is no longer possible, the rest is the final chunk."""
        hop = self.hop(index)
        if available - start >= hop + self.lookahead:
            return Chunk(start, start + hop, start + hop + self.lookahead, final=False)
        if finished:
            return Chunk(start, available, available, final=True)
        return None

    def chunks(self, n_tokens: int) -> list["Chunk"]:
        """All chunks of a stream of `n_tokens` tokens (the same however the tokens arrive)."""
        out: list[Chunk] = []
        start = 0
        while True:
            chunk = self.next_chunk(start, len(out), n_tokens, finished=True)
            assert chunk is not None
            out.append(chunk)
            if chunk.final:
                return out
            start = chunk.stop


def prompt_key(tokens: Sequence[int] | np.ndarray, mel: np.ndarray, xvector: np.ndarray) -> str:
    """sha256 over a prompt's tokens, mel and x-vector (values and shapes): the `VoiceCaches` key of a voice whose
    features come without a name (equal features, equal key)."""
    import hashlib

    digest = hashlib.sha256()
    for array in (np.asarray(tokens, dtype=np.int64), np.asarray(mel, dtype=np.float32),
                  np.asarray(xvector, dtype=np.float32)):
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


class VoiceCaches:
    """Prompt caches per voice key (e.g. a hash of the reference audio), least recently used dropped first."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, PromptCache] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, compute: Callable[[], PromptCache]) -> PromptCache:
        with self._lock:
            cache = self._items.get(key)
            if cache is not None:
                self._items.move_to_end(key)
                return cache
        cache = compute()  # outside the lock: a prefill takes a while; a concurrent duplicate is harmless
        with self._lock:
            self._items[key] = cache
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return cache

    def __len__(self) -> int:
        return len(self._items)


class DiTToken2Wav(FlowAndVocoder):
    """Stateless tokens -> audio for the DiT flow; one instance serves any number of streams.

    The flow runs in its parameters' dtype, HiFT in fp32 (as the reference). Streaming calls replay the DiT's
    step graphs (`graphs`, `cosyvoice2.dit.graphs`) once they are captured (`graphs.capture_all`), with buckets for
    this engine's own chunk schedule unless `use_graph_buckets` sets others; until then, and for shapes outside
    the buckets, they run eagerly.
    """

    def __init__(self, flow: DiTFlow, hift: HiFTGenerator, streaming: DiTStreamingConfig = DiTStreamingConfig()) -> None:
        # the DiT reference fades in float64
        super().__init__(flow, hift, streaming.mel_cache_len, hift.config.samples_per_frame,
                         flow.config.token_mel_ratio, np.float64)
        self.streaming = streaming
        self.lookahead = flow.config.pre_lookahead_len
        self.graphs = DiTStepGraphs(flow.decoder, self.graph_buckets([self.schedule]))
        self.use_hift_buckets([self.schedule], max(self.graphs.buckets.rows, default=1))

    def graph_buckets(self, schedules: Sequence[HopSchedule]) -> DiTGraphBuckets:
        """Step-graph buckets covering the chunks of `schedules`, for voice prompts up to the frontend's limit."""
        return DiTGraphBuckets.covering(schedules, self.flow.config, max_prompt_frames())

    def use_graph_buckets(self, buckets: DiTGraphBuckets) -> None:
        """Replace the step graphs by an empty set with these buckets (before capturing them)."""
        self.graphs = DiTStepGraphs(self.flow.decoder, buckets)

    @property
    def sample_rate(self) -> int:
        return self.hift.config.sampling_rate

    @property
    def samples_per_token(self) -> int:
        return self.token_mel_ratio * self.hift.config.samples_per_frame

    # ---- prompts ------------------------------------------------------------------------------------
    def _prompt_tensors(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, mel: np.ndarray | torch.Tensor,
                        xvector: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(1, P), (1, 2P, 80), (1, 192) on the flow device; tokens and mel cut to the shorter of the two
        (P = min(tokens, mel frames // 2)), as the reference runtime aligns them."""
        tokens = torch.as_tensor(np.asarray(tokens) if not torch.is_tensor(tokens) else tokens).long().view(-1)
        mel = torch.as_tensor(mel).float()
        if mel.dim() == 3:
            mel = mel[0]
        count = min(tokens.shape[0], mel.shape[0] // self.token_mel_ratio)
        tokens, mel = tokens[:count], mel[: count * self.token_mel_ratio]
        xvector = torch.as_tensor(xvector).float().view(1, -1)
        return (tokens[None].to(self.flow_device), mel[None].to(self.flow_device, self.flow_dtype),
                xvector.to(self.flow_device, self.flow_dtype))

    def prompt_cache(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, mel: np.ndarray | torch.Tensor,
                     xvector: np.ndarray | torch.Tensor) -> PromptCache:
        """The voice-dependent part of every stream (encoder + estimator caches of the prompt)."""
        return self.flow.prefill(*self._prompt_tensors(tokens, mel, xvector))

    # ---- offline ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def offline(self, tokens: Sequence[int], prompt_tokens: Sequence[int] | np.ndarray | torch.Tensor,
                prompt_mel: np.ndarray | torch.Tensor, xvector: np.ndarray | torch.Tensor,
                generator: torch.Generator, flow_noise: Optional[torch.Tensor] = None) -> np.ndarray:
        """All tokens at once: 960 samples per token, float32 24 kHz. The ODE start is drawn from `generator`
        (then HiFT's source noise), unless `flow_noise` (1, 80, 2 (P + N)) is given."""
        p_tokens, p_mel, xvec = self._prompt_tensors(prompt_tokens, prompt_mel, xvector)
        new = torch.as_tensor(list(tokens), dtype=torch.long, device=self.flow_device).view(1, -1)
        if new.shape[1] == 0:
            return np.zeros(0, dtype=np.float32)
        all_tokens = torch.cat([p_tokens, new], dim=1)
        frames = all_tokens.shape[1] * self.token_mel_ratio
        if flow_noise is None:
            flow_noise = torch.randn(1, self.flow.config.output_size, frames, generator=generator,
                                     device=generator.device)
        mel = self.flow.inference(all_tokens, torch.tensor([all_tokens.shape[1]], device=self.flow_device),
                                  [p_mel[0]], xvec, noise=flow_noise.to(self.flow_device))
        mel = mel[:, :, p_mel.shape[1]:].to(self.hift_device, torch.float32)
        audio, _ = self.hift.inference(mel, None, generator=generator)
        return audio[0].cpu().numpy()

    # ---- streaming ----------------------------------------------------------------------------------
    @property
    def schedule(self) -> DiTChunkSchedule:
        return DiTChunkSchedule(self.streaming, self.lookahead)

    def open_stream(self, prompt: PromptCache, generator: torch.Generator) -> "DiTStream":
        return DiTStream(self, prompt, generator)

    def offline_job(self, tokens: Sequence[int], prompt: PromptCache,
                    generator: torch.Generator) -> tuple["DiTStream", Chunk]:
        """A whole utterance as a one-chunk stream from the voice's prompt cache (one final chunk over all
        tokens), to batch with streaming chunks in `run_chunks`. Unlike `offline`, the prompt frames are not
        re-generated jointly with the utterance: its frames attend to the cached prompt K/V, as every chunk does."""
        stream = self.open_stream(prompt, generator)
        stream.extend(tokens)
        return stream, Chunk(0, len(stream.tokens), len(stream.tokens), final=True)

    @torch.inference_mode()
    def run_chunks(self, work: Sequence[tuple["DiTStream", Chunk]]) -> list[np.ndarray]:
        """Run the next chunk of each of several streams; HiFT runs once for all of them (rows padded and
        masked). A call that raises leaves every stream as it was, so its chunks can be retried."""
        self._check_work(work, "run_chunks")
        return self._vocode_and_emit(work, lambda: self._run_flows(work))

    @staticmethod
    def _check_work(work: Sequence[tuple["DiTStream", Chunk]], caller: str) -> None:
        streams = [stream for stream, _ in work]
        if len({id(stream) for stream in streams}) != len(streams):
            raise ValueError(f"{caller} takes at most one chunk per stream")
        for stream, chunk in work:
            stream.check_next(chunk)

    def _vocode_and_emit(self, work: Sequence[tuple["DiTStream", Chunk]],
                         flows_of: Callable[[], list[tuple[torch.Tensor, FlowState]]]) -> list[np.ndarray]:
        """HiFT once for all chunks (rows padded and masked) over the mels `flows_of()` gives (per chunk its mel
        on the HiFT device and its stream's next flow state), then each stream emits its chunk. Raising, it
        leaves every stream as it was (the noise generators are restored)."""
        streams = [stream for stream, _ in work]
        generator_states = [stream.generator.get_state() for stream in streams]
        try:
            flows = flows_of()
            inputs = [stream.hift_input(mel) for stream, (mel, _) in zip(streams, flows)]
            rows = [i for i, (mel, _) in enumerate(inputs) if mel.shape[2] > 0]
            noises = [self.hift.draw_noise(1, inputs[i][0].shape[2], streams[i].generator) for i in rows]
            vocoded = self.hift.inference_batch([inputs[i][0] for i in rows], [inputs[i][1] for i in rows],
                                                noises) if rows else []
        except BaseException:
            for stream, state in zip(streams, generator_states):
                stream.generator.set_state(state)
            raise
        results = dict(zip(rows, vocoded))
        out = []
        for i, (stream, chunk) in enumerate(work):
            flow_state = flows[i][1]
            if i in results:
                out.append(stream.emit(chunk, flow_state, inputs[i][0], *results[i]))
            else:
                out.append(stream.emit_nothing(chunk, flow_state))
        return to_host(out)

    def _run_flows(self, work: Sequence[tuple["DiTStream", Chunk]]) -> list[tuple[torch.Tensor, FlowState]]:
        """Each chunk's mel (1, 80, C) fp32 on the HiFT device and its stream's next flow state (not yet
        adopted); the chunks with tokens share one batched flow call."""
        out: list[Optional[tuple[torch.Tensor, FlowState]]] = [None] * len(work)
        rows = []
        for i, (stream, chunk) in enumerate(work):
            if chunk.feed == chunk.start:  # a final chunk without new tokens: only HiFT's cached frames remain
                out[i] = (torch.zeros(1, self.flow.config.output_size, 0, device=self.hift_device), stream.flow_state)
            else:
                rows.append(i)
        if rows:
            results = self.flow.chunks(
                [torch.tensor(work[i][0].tokens[work[i][1].start:work[i][1].feed], dtype=torch.long,
                              device=self.flow_device)[None] for i in rows],
                [work[i][0].flow_state for i in rows], [work[i][1].final for i in rows], self.graphs)
            for i, (_, mel, state) in zip(rows, results):
                out[i] = (mel.to(self.hift_device, torch.float32), state)
        return out  # type: ignore[return-value]


class DiTStream(ChunkedStream):
    """All state of one DiT stream; feed tokens as the LLM emits them.

    Audio: the first chunk emits 960 hop - 3840 samples (3840 withheld for the cross-fade), later non-final
    chunks 960 hop, the final chunk the rest plus the withheld samples: 960 N samples in all for N tokens.
    """

    def __init__(self, engine: DiTToken2Wav, prompt: PromptCache, generator: torch.Generator) -> None:
        self.engine = engine
        self.prompt = prompt
        self.generator = generator
        self.tokens: list[int] = []
        self.chunks: list[Chunk] = []
        self._flow: FlowState = FlowState.start(prompt)
        self._hift: Optional[HiFTCache] = None
        self.finished = False

    @property
    def flow_state(self) -> FlowState:
        return self._flow

    @property
    def schedule(self) -> DiTChunkSchedule:
        return self.engine.schedule

    # ---- the steps of one chunk, driven by `DiTToken2Wav.run_chunks` -----------------------------------
    def check_next(self, chunk: Chunk) -> None:
        if self.finished:
            raise RuntimeError("the stream already ran its final chunk")
        if chunk.start != self._start or not chunk.start <= chunk.stop <= chunk.feed <= len(self.tokens):
            raise ValueError(f"{chunk} does not continue the stream (at token {self._start} of {len(self.tokens)})")
        if not chunk.final and chunk.feed - chunk.stop != self.engine.lookahead:
            raise ValueError(f"a non-final chunk carries exactly {self.engine.lookahead} lookahead tokens")

    def hift_input(self, mel: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self._hift is None:
            return mel, None
        return torch.cat([self._hift.mel, mel], dim=2), self._hift.source

    def emit(self, chunk: Chunk, flow_state: FlowState, mel_in: torch.Tensor, audio: torch.Tensor,
             source: torch.Tensor) -> torch.Tensor:
        """Cross-fade, keep this chunk's HiFT cache, return its audio (on the device; `to_host` copies a call's)."""
        engine, cache = self.engine, self._hift
        if cache is not None:
            head = audio[: engine.overlap].double() * engine.fade_in + cache.speech.double() * engine.fade_out
            audio = torch.cat([head.float(), audio[engine.overlap:]])
        if chunk.final:
            self._hift = None
        else:
            self._hift = HiFTCache(mel_in[:, :, -engine.mel_cache_len:], source[:, :, -engine.overlap:],
                                   audio[-engine.overlap:])
            audio = audio[: -engine.overlap]
        self._advance(chunk, flow_state)
        return audio

    def emit_nothing(self, chunk: Chunk, flow_state: FlowState) -> np.ndarray:
        self._advance(chunk, flow_state)
        return np.zeros(0, dtype=np.float32)

    def _advance(self, chunk: Chunk, flow_state: FlowState) -> None:
        self._flow = flow_state
        self.chunks.append(chunk)
        self.finished = chunk.final
