"""Streaming token2wav: the chunk schedule and the per-stream state (docs/reference/cosyvoice2.md#streaming-schedule).

Three layers, each with one job:

* `ChunkSchedule` is pure arithmetic: which token range each flow call covers. No torch, unit-testable.
* `Token2Wav` is stateless: tokens -> mel (flow) and mel -> audio (HiFT) for one prompt.
* `Token2WavStream` owns *all* mutable state of one stream (token buffer, schedule position, flow caches, HiFT
  mel/source/speech caches, noise generator). Upstream keeps the hop length on the shared model object,
  so a second request starts with the grown hop; here nothing mutable is shared, so a server can keep one
  stream per request id and interleave them freely.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

import numpy as np

from cosyvoice2.host_copies import to_host

if TYPE_CHECKING:  # torch stays out of the pure schedule's import path
    import torch

    from cosyvoice2.config import EngineConfig
    from cosyvoice2.flow.cached import CachedRow, CachedSegment
    from cosyvoice2.frontend.prompt import VoicePrompt
    from cosyvoice2.hift.generator import HiFTBuckets

#: How streaming chunks use the flow: "off" recomputes prompt + all tokens for every chunk (upstream's way);
#: "exact" runs non-final chunks over per-stream caches (equal to recomputing) and recomputes the final chunk
#: with full attention as upstream does; "chunked" also runs the final chunk over the caches, with chunk
#: attention (cheapest; its final chunk differs slightly from upstream's full-attention one, docs/engine.md).
FLOW_CACHE_MODES = ("off", "exact", "chunked")


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
    #: The second chunk's hop when it does not follow from the first (CosyVoice3's served schedule: 15, then 25, 50,
    #: 100, ...); None: first_hop x growth, as upstream's.
    second_hop: int | None = None

    def __post_init__(self) -> None:
        if self.first_hop < 4:
            # the HiFT cache withholds 8 mel frames = 4 tokens; a smaller first chunk has nothing to emit
            raise ValueError(f"first_hop must be >= 4 tokens, got {self.first_hop}")
        if self.prompt_tokens < 0 or self.grid < 1 or self.max_hop < self.first_hop or self.growth < 1:
            raise ValueError(f"inconsistent chunk schedule {self}")
        if self.second_hop is not None and not 4 <= self.second_hop <= self.max_hop:
            raise ValueError(f"second_hop must lie in 4..max_hop, got {self.second_hop}")

    @property
    def prompt_pad(self) -> int:
        """Extra tokens in the first hop that align its end to the grid (0 when the prompt is aligned)."""
        return -self.prompt_tokens % self.grid

    def hop(self, index: int) -> int:
        """Tokens emitted by non-final chunk number `index` (0-based)."""
        if index == 0 or self.second_hop is None:
            base = self.first_hop * self.growth**index
        else:
            base = self.second_hop * self.growth ** (index - 1)
        return min(self.max_hop, base) + (self.prompt_pad if index == 0 else 0)

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

    def boundaries(self, max_tokens: int) -> list[int]:
        """The token counts at which the next non-final chunk becomes runnable (hop + lookahead past its
        start), ascending, up to `max_tokens`: a stream's tokens are needed there and at the end, never between."""
        out: list[int] = []
        start, index = 0, 0
        while (due := start + self.hop(index) + self.lookahead) <= max_tokens:
            out.append(due)
            start, index = start + self.hop(index), index + 1
        return out

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


class HopSchedule(Protocol):
    """A chunk schedule as CUDA-graph buckets read it (`ChunkSchedule`, the DiT's `DiTChunkSchedule`)."""

    lookahead: int

    def hop(self, index: int) -> int: ...


def vocoder_frames(schedule: HopSchedule, token_mel_ratio: int, mel_cache_len: int, max_chunks: int = 64) -> set[int]:
    """Mel frames of every HiFT call a stream of `schedule` can make, until the hop stops changing.

    Chunk i vocodes its tokens' `token_mel_ratio` frames each, after the `mel_cache_len` frames the previous chunk
    withheld (none before the first chunk): hop tokens when it is not final; as the final chunk, what is left when
    fewer than hop + lookahead tokens remain - 1 token up (a stream of one chunk), or `lookahead` up (a later chunk
    follows a non-final one, which ran only with its lookahead there)."""
    frames: set[int] = set()
    previous = None
    for index in range(max_chunks):
        hop = schedule.hop(index)
        if index >= 2 and hop == previous:
            break
        withheld, fewest = (0, 1) if index == 0 else (mel_cache_len, schedule.lookahead)
        frames.update(withheld + token_mel_ratio * tokens for tokens in range(fewest, hop + schedule.lookahead))
        previous = hop
    return frames


def hift_buckets(schedules: Iterable[HopSchedule], max_rows: int, token_mel_ratio: int, mel_cache_len: int,
                 samples_per_frame: int) -> "HiFTBuckets":
    """HiFT graph buckets for every call of up to `max_rows` streams' chunks of `schedules` (pass one schedule per
    first hop a stream may have, e.g. per prompt alignment): rows 1, 2, 4, ... up to `max_rows`, each call's mel
    frames rounded up (`vocoder_frames`), the cache source padded to the samples of the `mel_cache_len` frames a
    chunk leaves."""
    from cosyvoice2.hift.generator import HiFTBuckets
    from speech_lm.graph_buckets import row_buckets

    frames: set[int] = set()
    for schedule in schedules:
        frames |= vocoder_frames(schedule, token_mel_ratio, mel_cache_len)
    return HiFTBuckets.covering(frames, row_buckets(max_rows), mel_cache_len * samples_per_frame)


# ---- token2wav ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlowPrompt:
    """A voice prompt's flow inputs as tensors on the flow's device (built once per stream/request)."""

    tokens: "torch.Tensor"  # (1, P) int64
    mel: "torch.Tensor"  # (1, 2P, 80) flow dtype, time-major
    xvector: "torch.Tensor"  # (1, 192) flow dtype
    key: str | None = None  # content digest: streams of the same voice share its cached flow prefix

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])


class FlowAndVocoder:
    """What both token2wav engines hold: a flow (run in its parameters' device and dtype, `token_mel_ratio` mel
    frames per token) and the HiFT vocoder, and the cross-fade of `mel_cache_len` frames between two chunks' audio,
    made as the reference makes it (numpy's symmetric Hamming window of 2 x overlap samples, computed in
    `fade_dtype`)."""

    def __init__(self, flow: "torch.nn.Module", hift: "torch.nn.Module", mel_cache_len: int, samples_per_frame: int,
                 token_mel_ratio: int, fade_dtype: type = np.float32) -> None:
        import torch

        self.flow = flow
        self.hift = hift
        self.token_mel_ratio = token_mel_ratio
        weight = flow.input_embedding.weight
        self.flow_device, self.flow_dtype = weight.device, weight.dtype
        self.hift_device = hift.stft_window.device
        self.mel_cache_len = mel_cache_len
        self.samples_per_frame = samples_per_frame
        self.overlap = mel_cache_len * samples_per_frame
        window = torch.from_numpy(np.hamming(2 * self.overlap).astype(fade_dtype)).to(self.hift_device)
        self.fade_in, self.fade_out = window[: self.overlap], window[self.overlap :]  # new chunk's, old chunk's

    def hift_buckets(self, schedules: Iterable[HopSchedule], max_rows: int) -> "HiFTBuckets":
        """`hift_buckets` of this engine's flow and vocoder."""
        return hift_buckets(schedules, max_rows, self.token_mel_ratio, self.mel_cache_len, self.samples_per_frame)

    def use_hift_buckets(self, schedules: Iterable[HopSchedule], max_rows: int) -> None:
        """Give HiFT's graphs the buckets of every call of up to `max_rows` chunks of `schedules` (as given: one
        schedule per first hop), dropping graphs captured for others; `capture_hift_graphs` captures them."""
        if self.hift.cuda_graphs is not None:
            self.hift.cuda_graphs.use_buckets(self.hift_buckets(schedules, max_rows))

    def capture_hift_graphs(self) -> int:
        """Capture HiFT's graphs of every bucket now, on HiFT's own device; returns how many (0 off CUDA)."""
        graphs = self.hift.cuda_graphs
        if graphs is None or self.hift_device.type != "cuda":
            return 0
        return graphs.capture_all(self.hift_device)

    def new_generator(self, seed: int | None) -> "torch.Generator":
        """The vocoder's noise source for one stream (seeded, or random when `seed` is None)."""
        import torch

        generator = torch.Generator(device=self.hift_device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator


def prompt_digest(*arrays: np.ndarray) -> str:
    """A key for a voice prompt's content (tokens, mel, x-vector): equal prompts share flow caches."""
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(str((array.dtype.str, array.shape)).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


@dataclass
class StreamFlowCache:
    """A stream's flow caches: the voice's shared prefix and what the stream's own chunks added."""

    prefix: "CachedSegment"
    own: "CachedSegment"
    pending: "CachedSegment | None" = None  # what the running chunk adds, committed when its audio is emitted
    # The budget refused a growth: the caches stay as they are (and stay accounted), and every later chunk
    # recomputes the frames since their end instead of adding to them. Exact like any cached call; it costs only
    # the frames since the freeze, where dropping the caches would recompute prompt and history on every chunk.
    frozen: bool = False


@dataclass(frozen=True)
class FlowCall:
    """One flow call: the flow runs over prompt + tokens and returns the mel of tokens[start:]."""

    tokens: Sequence[int]
    prompt: FlowPrompt
    start: int
    final: bool  # full attention, no lookahead; otherwise chunk attention and the last 3 tokens are context only
    stop: int = -1  # one past the last token whose mel is wanted (cached calls; the rest is lookahead)
    cache: StreamFlowCache | None = None  # run over the stream's caches instead of recomputing the prefix


@dataclass(frozen=True)
class HiFTCache:
    """What a non-final chunk leaves for the next one (upstream hift_cache_dict entry)."""

    mel: "torch.Tensor"  # (1, 80, mel_cache_len) last mel frames, re-vocoded by the next chunk
    source: "torch.Tensor"  # (1, 1, overlap) last source samples, forced into the next chunk's source
    speech: "torch.Tensor"  # (overlap,) withheld audio, cross-faded with the next chunk's first samples


@dataclass(eq=False)
class CacheBudget:
    """The bytes that live streams' own flow caches hold against an optional budget (None: no limit), shared by
    the threads that run chunks. A stream whose caches would pass the budget stops growing them (`frozen`)."""

    budget_bytes: int | None = None
    nbytes: int = 0
    refused: int = 0  # growths refused so far (each freezes one stream's caches)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reserve(self, nbytes: int) -> bool:
        """Account `nbytes` more (negative: fewer); False (nothing accounted) when a growth would pass the budget.
        A shrink is always accepted: it frees memory."""
        with self.lock:
            if nbytes > 0 and self.budget_bytes is not None and self.nbytes + nbytes > self.budget_bytes:
                self.refused += 1
                return False
            self.nbytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.nbytes -= nbytes


@dataclass(eq=False)
class FlowCacheBook(CacheBudget):
    """The flow caches of one `Token2Wav`: the voice prefixes (LRU by prompt digest) and the bytes that live
    streams' own caches hold against the budget."""

    prefixes: "OrderedDict[str, CachedSegment]" = field(default_factory=OrderedDict)


class Token2Wav(FlowAndVocoder):
    """Stateless token -> audio conversion (flow + HiFT); one instance serves any number of streams.

    Batching: `run_chunks` runs one chunk of each of several streams (and offline utterances, as one-chunk
    streams) together: one flow forward per attention mode (rows of any lengths: packed on one frame axis over the
    flow caches, `flow.packed`; padded and masked when recomputed, `flow_cache="off"`) and one HiFT forward
    (padded and masked). Every stream keeps its own HiFT caches and noise generator and draws
    exactly what it would draw alone, so its audio is the same batched or not (up to float rounding).

    The flow runs in the model dtype; HiFT always runs in fp32 (as upstream). HiFT's source noise comes from
    the caller's `torch.Generator`, so a seeded request is reproducible whatever else runs.
    """

    def __init__(self, flow: "torch.nn.Module", hift: "torch.nn.Module", config: "EngineConfig",
                 flow_cache: str = "exact", prefix_capacity: int = 8, cache_budget_bytes: int | None = None,
                 max_rows: int | None = None) -> None:
        """`max_rows`: the rows (streams' chunks) one call's CUDA graphs take at most (default: the packed solve's
        `PACKED_ROWS`); a call of more runs eagerly."""
        from cosyvoice2.flow.cached import CachedFlowRunner

        if flow_cache not in FLOW_CACHE_MODES:
            raise ValueError(f"flow_cache must be one of {FLOW_CACHE_MODES}, got {flow_cache!r}")
        self.flow_cache = flow_cache
        self.cached = CachedFlowRunner(flow, max_rows=max_rows)
        self.prefix_capacity = prefix_capacity
        self.book = FlowCacheBook(cache_budget_bytes)
        super().__init__(flow, hift, config.streaming.mel_cache_len, config.hift.samples_per_frame,
                         config.flow.token_mel_ratio)
        self.config = config
        # HiFT's graph buckets for this engine's own schedule and every prompt length (a server sets its own)
        own = config.schedule(0)
        self.use_hift_buckets([replace(own, prompt_tokens=p) for p in range(own.grid)],
                              self.cached.max_rows or 1)

    @property
    def cache_bytes(self) -> int:
        """Bytes of live streams' own flow caches."""
        return self.book.nbytes

    def flow_prompt(self, prompt: "VoicePrompt") -> FlowPrompt:
        import torch

        def tensor(array: np.ndarray, dtype: "torch.dtype") -> "torch.Tensor":
            return torch.as_tensor(array).to(self.flow_device, dtype).unsqueeze(0)

        return FlowPrompt(tensor(prompt.speech_tokens, torch.long), tensor(prompt.prompt_mel, self.flow_dtype),
                          tensor(prompt.xvector, self.flow_dtype),
                          prompt_digest(prompt.speech_tokens, prompt.prompt_mel, prompt.xvector))

    # ---- flow caches ----------------------------------------------------------------------------------
    def prefix(self, prompt: FlowPrompt) -> "CachedSegment":
        """The voice's shared flow prefix (computed on first use, kept for the `prefix_capacity` latest voices)."""
        key, book = prompt.key, self.book
        if key is not None:
            with book.lock:
                if key in book.prefixes:
                    book.prefixes.move_to_end(key)
                    return book.prefixes[key]
        segment = self.cached.prefix(prompt.tokens[0], prompt.mel[0], self._speaker(prompt))
        if key is not None and self.prefix_capacity > 0:
            with book.lock:
                book.prefixes[key] = segment
                while len(book.prefixes) > self.prefix_capacity:
                    book.prefixes.popitem(last=False)
        return segment

    def _speaker(self, prompt: FlowPrompt) -> "torch.Tensor":
        return self.cached.project_speaker(prompt.xvector)[0]

    def reserve_cache(self, nbytes: int) -> bool:
        """Account `nbytes` of new stream caches; False (nothing reserved) when that would pass the budget."""
        return self.book.reserve(nbytes)

    def release_cache(self, nbytes: int) -> None:
        self.book.release(nbytes)

    def mels(self, calls: Sequence[FlowCall]) -> "list[torch.Tensor]":
        """Mel (1, 80, frames) fp32 on the HiFT device per call; the calls of one attention mode share a forward.

        Non-final calls use chunk attention and treat the last `pre_lookahead_len` tokens as context only;
        final calls use full attention, as upstream (docs/reference/cosyvoice2.md#streaming-at-the-flow-level).
        """
        import torch

        out: "list[torch.Tensor | None]" = [None] * len(calls)
        cached = [i for i, call in enumerate(calls) if call.cache is not None]
        if cached:
            for i, mel in zip(cached, self._cached_mels([calls[i] for i in cached])):
                out[i] = mel
        for final in (False, True):
            rows = [i for i, call in enumerate(calls) if call.final == final and call.cache is None]
            if not rows:
                continue
            mels = self.flow.inference_batch(
                [torch.as_tensor(calls[i].tokens, dtype=torch.long, device=self.flow_device).view(-1) for i in rows],
                [calls[i].prompt.tokens[0] for i in rows],
                [calls[i].prompt.mel[0] for i in rows],
                torch.cat([calls[i].prompt.xvector for i in rows]),
                streaming=not final,
                finalize=final,
            )
            for i, mel in zip(rows, mels):
                start_frame = calls[i].start * self.config.flow.token_mel_ratio
                out[i] = mel[None, :, start_frame:].to(self.hift_device, torch.float32)
        return out  # type: ignore[return-value]

    def _cached_row(self, call: FlowCall) -> "CachedRow":
        import torch

        from cosyvoice2.flow.cached import CachedRow

        assert call.cache is not None
        prompt = call.prompt
        tokens = torch.cat([prompt.tokens[0], torch.as_tensor(call.tokens, dtype=torch.long,
                                                               device=self.flow_device).view(-1)])
        offset = prompt.num_tokens
        return CachedRow(tokens, prompt.mel[0], self._speaker(prompt), call.cache.prefix, call.cache.own,
                         stop=offset + call.stop, final=call.final, keep=not (call.final or call.cache.frozen),
                         emit_from=offset + call.start)

    def _cached_mels(self, calls: Sequence[FlowCall]) -> "list[torch.Tensor]":
        """Cached calls in one batched forward; each call's new caches wait in `cache.pending` until emitted."""
        import torch

        mels, updates = self.cached.run_pending([self._cached_row(call) for call in calls])
        for call, update in zip(calls, updates):
            assert call.cache is not None
            call.cache.pending = update
        return [mel[None].to(self.hift_device, torch.float32) for mel in mels]

    def mel(self, tokens: "Sequence[int] | torch.Tensor", prompt: FlowPrompt, start: int, final: bool) -> "torch.Tensor":
        """`mels` of one call."""
        return self.mels([FlowCall(tokens, prompt, start, final)])[0]

    def vocode_batch(self, mels: "Sequence[torch.Tensor]", cache_sources: "Sequence[torch.Tensor | None]",
                     generators: "Sequence[torch.Generator]") -> "list[tuple[torch.Tensor, torch.Tensor]]":
        """(1, 80, M_i) mels -> [(audio (480 M_i,), source (1, 1, 480 M_i))] in one HiFT forward; each row's
        noise is drawn from its own generator for its own length, exactly as a call alone draws it."""
        noises = [self.hift.draw_noise(1, mel.shape[2], generator) for mel, generator in zip(mels, generators)]
        return self.hift.inference_batch(mels, cache_sources, noises)

    def vocode(self, mel: "torch.Tensor", cache_source: "torch.Tensor | None",
               generator: "torch.Generator") -> "tuple[torch.Tensor, torch.Tensor]":
        """`vocode_batch` of one call."""
        return self.vocode_batch([mel], [cache_source], [generator])[0]

    def run_chunks(self, work: "Sequence[tuple[Token2WavStream, Chunk]]") -> list[np.ndarray]:
        """Run the next chunk of each of several streams (one chunk per stream) in one batched flow + HiFT pass.

        Each chunk must continue its stream (start where the last one stopped, its tokens already added). A call
        that raises leaves every stream as it was (tokens, caches and generator state), so its chunks can be
        retried one by one.
        """
        streams = [stream for stream, _ in work]
        if len({id(stream) for stream in streams}) != len(streams):
            raise ValueError("run_chunks takes at most one chunk per stream")
        for stream, chunk in work:
            stream.check_next(chunk)
        return self._vocode_and_emit(
            work, lambda: self.mels([stream.flow_call(chunk) for stream, chunk in work]))

    def _vocode_and_emit(self, work: "Sequence[tuple[Token2WavStream, Chunk]]",
                         mels: "Callable[[], list[torch.Tensor]]") -> list[np.ndarray]:
        """The chunks' mels (from `mels()`, flow caches set pending) through one batched HiFT pass, then emitted
        (caches committed). If anything before the emit raises, every stream is left as it was."""
        import torch

        streams = [stream for stream, _ in work]
        generator_states = [stream.generator.get_state() for stream in streams]
        try:
            with torch.inference_mode():
                inputs = [stream.hift_input(mel) for stream, mel in zip(streams, mels())]
                rows = [i for i, (mel, _) in enumerate(inputs) if mel.shape[2] > 0]  # an empty stream has nothing
                vocoded = self.vocode_batch([inputs[i][0] for i in rows], [inputs[i][1] for i in rows],
                                            [streams[i].generator for i in rows]) if rows else []
        except BaseException:
            for stream, state in zip(streams, generator_states):
                stream.generator.set_state(state)
                stream.discard_pending()
            raise
        results = dict(zip(rows, vocoded))
        with torch.inference_mode():
            return to_host([stream.emit(chunk, inputs[i][0], *results[i]) if i in results
                            else stream.emit_nothing(chunk) for i, (stream, chunk) in enumerate(work)])

    def offline_job(self, tokens: "Sequence[int]", prompt: FlowPrompt,
                    generator: "torch.Generator") -> "tuple[Token2WavStream, Chunk]":
        """An utterance as a one-chunk stream (one final chunk over all tokens), to batch with `run_chunks`."""
        stream = self.open_stream(prompt, generator)
        stream.extend(tokens)
        return stream, Chunk(start=0, stop=len(stream.tokens), feed=len(stream.tokens), final=True)

    def offline(self, tokens: "Sequence[int]", prompt: FlowPrompt, generator: "torch.Generator") -> np.ndarray:
        """All tokens at once (upstream stream=False): 960 samples per token, float32 24 kHz."""
        return self.run_chunks([self.offline_job(tokens, prompt, generator)])[0]

    def open_stream(self, prompt: FlowPrompt, generator: "torch.Generator",
                    first_hop: int | None = None) -> "Token2WavStream":
        return Token2WavStream(self, prompt, self.config.schedule(prompt.num_tokens, first_hop), generator)


class ChunkedStream:
    """The token-feeding side of a stream, shared by both token2wavs: a token buffer, the schedule's next chunk,
    and `push`/`finish` that run the chunks that became ready, alone. Subclasses provide `tokens`, `chunks`,
    `finished`, `schedule` (with `next_chunk`) and `engine` (with `run_chunks`)."""

    tokens: list[int]
    chunks: list[Chunk]
    finished: bool

    @property
    def _start(self) -> int:
        return self.chunks[-1].stop if self.chunks else 0

    def extend(self, tokens: Iterable[int]) -> None:
        """Add newly generated tokens without running anything."""
        if self.finished:
            raise RuntimeError("tokens added after the final chunk")
        self.tokens.extend(int(t) for t in tokens)

    def next_chunk(self, finished: bool) -> Chunk | None:
        """The schedule's next chunk over the tokens added so far (`finished`: the LLM is done), or None."""
        if self.finished:
            return None
        return self.schedule.next_chunk(self._start, len(self.chunks), len(self.tokens), finished)

    def push(self, tokens: Iterable[int]) -> list[np.ndarray]:
        """Add newly generated tokens; returns the audio chunks that became ready (possibly none)."""
        self.extend(tokens)
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
        while (chunk := self.next_chunk(finished)) is not None:
            out.extend(self.engine.run_chunks([(self, chunk)]))
        return out


class Token2WavStream(ChunkedStream):
    """All state of one streaming request; feed tokens as the LLM emits them.

    Audio per chunk: a non-final chunk emits 2 x hop x 480 samples (the first one 3840 fewer, held back for
    the cross-fade), the final chunk emits the rest plus the held-back 3840, so a stream of N tokens yields
    exactly 960 N samples in total, like `Token2Wav.offline`.

    `push`/`finish` run the chunks that became ready, alone. A batching caller instead `extend`s several
    streams, takes each one's `next_chunk` and runs them together with `Token2Wav.run_chunks`.
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
        self.flow_cache: StreamFlowCache | None = None  # set on the first cached chunk
        self._flow_cache_bytes = 0
        self._cache_off = engine.flow_cache == "off"

    # ---- the steps of one chunk, driven by `Token2Wav.run_chunks` ----------------------------------------
    def check_next(self, chunk: Chunk) -> None:
        if self.finished:
            raise RuntimeError("the stream already ran its final chunk")
        if chunk.start != self._start or not chunk.start <= chunk.stop <= chunk.feed <= len(self.tokens):
            raise ValueError(f"{chunk} does not continue the stream (at token {self._start} of {len(self.tokens)})")

    def uses_flow_cache(self, chunk: Chunk) -> bool:
        """Whether `chunk` runs over the flow caches (else it recomputes prompt + all tokens)."""
        return not (self._cache_off or (chunk.final and self.engine.flow_cache == "exact"))

    def flow_call(self, chunk: Chunk) -> FlowCall:
        if not self.uses_flow_cache(chunk):
            return FlowCall(self.tokens[: chunk.feed], self.prompt, chunk.start, chunk.final)
        if self.flow_cache is None:
            from cosyvoice2.flow.cached import CachedSegment

            self.flow_cache = StreamFlowCache(self.engine.prefix(self.prompt), CachedSegment())
        return FlowCall(self.tokens[: chunk.feed], self.prompt, chunk.start, chunk.final, stop=chunk.stop,
                        cache=self.flow_cache)

    def discard_pending(self) -> None:
        if self.flow_cache is not None:
            self.flow_cache.pending = None

    def _commit_flow_cache(self, chunk: Chunk) -> None:
        """Keep what this chunk added to the flow caches (within the engine's budget), or freeze them."""
        cache = self.flow_cache
        if cache is None:
            return
        update, cache.pending = cache.pending, None
        if chunk.final:
            self.release_flow_cache()
            return
        if update is None:
            return
        nbytes = update.nbytes()
        if self.engine.reserve_cache(nbytes):
            self.engine.cached.commit(cache.own, update)
            self._flow_cache_bytes += nbytes
        else:  # over budget: keep what is cached, recompute the frames after it from now on
            cache.frozen = True

    def release_flow_cache(self) -> None:
        """Free this stream's own flow caches (final chunk, budget, or the stream is dropped)."""
        self.flow_cache = None
        if self._flow_cache_bytes:
            self.engine.release_cache(self._flow_cache_bytes)
            self._flow_cache_bytes = 0

    def __del__(self) -> None:  # a stream dropped mid-utterance (cancelled, expired) returns its budget
        try:
            self.release_flow_cache()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def hift_input(self, mel: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor | None]":
        """This chunk's HiFT input: the cached mel frames re-vocoded before the new ones, and the cached source."""
        import torch

        if self._cache is None:
            return mel, None
        return torch.cat([self._cache.mel, mel], dim=2), self._cache.source

    def emit(self, chunk: Chunk, mel: "torch.Tensor", audio: "torch.Tensor", source: "torch.Tensor") -> "torch.Tensor":
        """Cross-fade with the held-back audio, keep this chunk's cache, return its audio (on the device: the
        caller copies a whole call's audio to the host at once)."""
        import torch

        engine, cache = self.engine, self._cache
        if cache is not None:
            faded = audio[: engine.overlap] * engine.fade_in + cache.speech * engine.fade_out
            audio = torch.cat([faded, audio[engine.overlap :]])
        if chunk.final:
            self._cache = None
        else:
            self._cache = HiFTCache(mel[:, :, -engine.mel_cache_len :], source[:, :, -engine.overlap :],
                                    audio[-engine.overlap :])
            audio = audio[: -engine.overlap]
        self._advance(chunk)
        return audio

    def emit_nothing(self, chunk: Chunk) -> np.ndarray:
        """A chunk of an empty stream (no tokens, nothing cached): no audio."""
        self._advance(chunk)
        return np.zeros(0, dtype=np.float32)

    def _advance(self, chunk: Chunk) -> None:
        self._commit_flow_cache(chunk)
        self.chunks.append(chunk)
        self.finished = chunk.final
