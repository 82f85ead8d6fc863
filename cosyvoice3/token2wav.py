"""CosyVoice3 token2wav: speech tokens + voice prompt -> 24 kHz audio, offline and streaming.

Offline: one flow call over prompt + all tokens (full attention), one vocoder call.

Streaming follows the served runtime's schedule and arithmetic (`CosyVoice3Streaming`): chunks of 15 tokens,
then 25, 50, 100, 200, ... (doubling without a cap), each non-final chunk carrying 3 more tokens as lookahead
context; the rest forms the final chunk. Chunk k runs the flow over prompt + every token so far with the chunked
attention mask (non-final) or full attention (final), keeps the mel of its own tokens and vocodes it after the
stream's earlier mel (causal HiFT, `finalize` only on the final chunk), emitting the samples beyond those already
sent. The reference vocodes the whole accumulated mel every chunk; by default (`windowed_vocoder`) a chunk vocodes
only a window of it (its new frames and the context the causal layers read, `CausalHiFT.stream_chunks`), with the
same samples up to float rounding. A stream of N tokens emits exactly 960 N samples.

Two flow paths, the same numbers up to float rounding:
- recompute (the reference): every chunk re-runs prompt + tokens from scratch;
- cached (`cached=True`): per stream, per Euler step and per DiT block, the attention keys/values of every frame in
  a complete 50-frame chunk are kept, with the ODE state of the frames the conv position embedding still needs.
  Under the chunk mask such frames never see a later frame, and their inputs (tokens with their real lookahead,
  prompt mel, noise) never change, so their values are final: a chunk only computes the frames from the last
  complete chunk on. The final chunk (full attention) is recomputed, as in the reference; with
  `final_over_cache` (render option `--cosyvoice3-flow-cache chunked`) it continues the cache under the chunk mask
  like the others: its new frames only, within the step graphs' buckets, where the reference's whole call over the
  prompt and every token runs eagerly (its frames then differ from the reference's by what full attention lets
  earlier frames see of later ones; a final chunk that is the stream's first stays a whole call). The live streams'
  own caches share an optional memory budget (`cache_budget_bytes`): a stream whose next cache would pass it
  drops its cache and recomputes from then on (`CosyVoice3Stream`).

`run_chunks` solves the flow of a call's cached chunks and offline jobs together (`batched_solve`: rows padded and
masked so each sees only its own frames, one estimator pass per Euler step) and vocodes the call's windows together
where they allow it; streams without a flow cache keep the reference flow path one by one (docs/cosyvoice3.md,
"Batched calls").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cosyvoice2.dit.token2wav import DiTChunkSchedule, DiTStreamingConfig, VoiceCaches, prompt_key
from cosyvoice2.host_copies import to_device
from cosyvoice2.streaming import CacheBudget, Chunk, ChunkedStream
from speech_lm.graph_buckets import fitting_first

from .errors import CosyVoice3InputError
from .flow import CosyVoice3Flow, FlowInputs
from .graphs import ROW_BUCKETS, FlowGraphBuckets, FlowStepGraphs, HopSchedule, Shape, StepInputs
from .hift import CausalHiFT, VocoderState
from .vocoder_graphs import WindowBuckets, WindowGraphs

#: Doubling hops without a cap: `max_hop` only has to exceed any stream's length.
_UNCAPPED = 1 << 30
#: The live cached streams' flow-cache budget a server gives them on an 80 GB-class GPU, and the most it gives them
#: when it sizes the budget to a smaller GPU (`cosyvoice2.flow.memory.flow_cache_budget_bytes`).
FLOW_CACHE_MOST_GIB = 16.0


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
    frame) are final; kv[step] (depth, 2, 2, H, committed, dim_head): per DiT block its keys then its values, each
    for the conditional and the unconditional row (one tensor per step: one copy stages a step's history);
    context[step] = the ODE state entering that step for the `committed` frames' last
    `context` frames (what the causal conv position embedding of later frames reads)."""

    committed: int = 0
    kv: list[torch.Tensor] = field(default_factory=list)
    context: list[torch.Tensor] = field(default_factory=list)

    def tensors(self) -> Iterable[torch.Tensor]:
        yield from self.kv
        yield from self.context

    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors())


@dataclass(frozen=True)
class FlowRow:
    """One row of a batched flow solve: a call's inputs, the cache its frames before `cache.committed` come from
    (an empty cache: the whole call), and its attention: the chunk mask (`streaming`) or full attention (only
    from an empty cache: no frame of a full-attention call is final before the call). `extend`: a chunk-mask
    row's solve extends its cache to the call's complete chunks; False for a stream's last call (a final chunk
    over the cache), whose cache nothing reads again (no copy of its history per step)."""

    inputs: FlowInputs
    cache: FlowCache
    streaming: bool
    extend: bool = True

    @property
    def start(self) -> int:
        return self.cache.committed

    @property
    def new_frames(self) -> int:
        return self.inputs.frames - self.cache.committed


@dataclass
class FrameCounts:
    """The flow estimator's new frames over the solves counted: `needed` (the rows' own) and `computed` (the rows
    and frames each solve ran, padded to its longest row and to its graph bucket), per conditional/unconditional
    pair. Their difference is the padding the served stage table shows (`token2wav_flow_frames_*`)."""

    needed: int = 0
    computed: int = 0


def batched_solve(flow: CosyVoice3Flow, rows: Sequence[FlowRow], graphs: Optional[FlowStepGraphs] = None,
                  counts: Optional[FrameCounts] = None) -> list[tuple[torch.Tensor, FlowCache]]:
    """Euler solves of several calls in lock step, one estimator pass per step for all rows (conditional and
    unconditional rows stacked): per row, the mel of frames [start, T) (1, 80, T - start) float32 and its cache
    extended to every complete chunk of the call (for a chunk-mask row; a full-attention row's has nothing to keep).

    Rows are right-padded to the longest new-frame count N, their cached keys/values to the longest history P,
    their conv context left-padded to R frames; masks make each row see exactly its own history and new frames,
    so a row's numbers equal its solve alone up to float summation order. Every tensor of a step has a shape fixed
    by (rows, N, P, R) and the step has no host syncs. `graphs`: when the call fits one of their buckets it is
    padded further, to the bucket (padded rows: full attention over their own zero frames), and every step's
    estimator pass is replayed from the bucket's CUDA graph (or, emulated, run on its static buffers). `counts`:
    what the solve needed and computed is added to it."""
    cfm = flow.decoder
    for row in rows:
        if row.new_frames <= 0 or (row.start and not row.streaming):
            raise ValueError(f"a flow row needs new frames, and full attention an empty cache (start {row.start}, "
                             f"{row.inputs.frames} frames)")
        if row.inputs.frames > cfm.rand_noise.size(-1):
            raise CosyVoice3InputError(f"a flow call of {row.inputs.frames} frames exceeds the "
                                       f"{cfm.rand_noise.size(-1)}-frame noise table")
    starts = [row.start for row in rows]
    news = [row.new_frames for row in rows]
    shape = None if graphs is None else graphs.bucket(len(rows), max(news), max(starts), rows[0].inputs.mu)
    if counts is not None:
        counts.needed += sum(news)
        counts.computed += len(rows) * max(news) if shape is None else shape[0] * shape[1]
    if graphs is None or shape is None:
        return _solve(flow, rows, None, None)
    with graphs.lock:
        return _solve(flow, rows, graphs, shape)


def _solve(flow: CosyVoice3Flow, rows: Sequence[FlowRow], graphs: Optional[FlowStepGraphs],
           shape: Optional[Shape]) -> list[tuple[torch.Tensor, FlowCache]]:
    """`batched_solve` at the call's own sizes (shape None: eager) or at a bucket's (its static inputs, replayed)."""
    estimator, cfm = flow.estimator, flow.decoder
    receptive = estimator.input_embed.conv_pos_embed.receptive_field
    chunk = estimator.config.static_chunk_size
    rate = cfm.config.inference_cfg_rate
    batch = len(rows)
    starts = [row.start for row in rows]
    counts = [row.new_frames for row in rows]
    contexts = [min(start, receptive) for start in starts]
    if shape is None:
        padded, n, history, width = batch, max(counts), max(starts), max(contexts)
    else:
        (padded, n, history), width = shape, receptive
    like = rows[0].inputs.mu
    device, dtype = like.device, like.dtype
    bins = like.shape[1]
    # padded rows: every frame real, no history, full attention (finite, and never read back)
    starts_p, counts_p = starts + [0] * (padded - batch), counts + [n] * (padded - batch)
    streaming_p = [row.streaming for row in rows] + [False] * (padded - batch)

    # the call's constant inputs: mu, cond, speaker, noise, and per row its history, new frames and attention mode
    # (the pass derives the frame validity, positions and masks from those: `StepInputs.run`)
    mu = torch.zeros(padded, bins, width + n, dtype=dtype, device=device)
    cond = torch.zeros_like(mu)
    x = torch.zeros(padded, bins, n, dtype=dtype, device=device)
    for i, (row, start, count, context) in enumerate(zip(rows, starts, counts, contexts)):
        frames = slice(width - context, width + count)
        mu[i, :, frames] = row.inputs.mu[0, :, start - context:]
        cond[i, :, frames] = row.inputs.cond[0, :, start - context:]
        x[i, :, :count] = cfm.rand_noise[0, :, start:start + count].to(mu)
    spks = F.pad(torch.cat([row.inputs.spks for row in rows]), (0, 0, 0, padded - batch))
    constants = dict(mu=torch.cat([mu, torch.zeros_like(mu)]), cond=torch.cat([cond, torch.zeros_like(cond)]),
                     spks=torch.cat([spks, torch.zeros_like(spks)]), start=to_device(2 * starts_p, device),
                     count=to_device(2 * counts_p, device), streaming=to_device(2 * streaming_p, device, torch.bool))
    if graphs is not None and shape is not None:
        inputs = graphs.inputs(shape, like)
        for name, value in constants.items():
            getattr(inputs, name).copy_(value)
    else:
        depth, config = len(estimator.transformer_blocks), estimator.config
        past = (like.new_zeros(depth, 2, 2 * batch, config.heads, history, config.dim_head) if history else None)
        inputs = StepInputs(window=x, t=like.new_zeros(2 * batch), past=past, context=width, history=history,
                            **constants)
    caches = [_RowCache(row, i, padded, width, context, receptive, chunk)
              for i, (row, context) in enumerate(zip(rows, contexts))]
    for step, (t, dt) in enumerate(cfm.schedule):
        # staging (a graph's static inputs): the ODE state with the rows' cached context state of this step, t, and
        # the rows' cached keys/values of this step; stale frames beyond a row's history stay masked
        inputs.window = _window(rows, contexts, step, width, x, inputs.window if shape is not None else None)
        inputs.t.fill_(t)
        for i, row in enumerate(rows):
            if row.start:
                inputs.past[:, :, i::padded, :, :row.start].copy_(row.cache.kv[step])  # type: ignore[index]
        velocity, own = graphs.run(shape) if graphs is not None and shape is not None else inputs.run(estimator)
        x = x + dt * ((1.0 + rate) * velocity[:padded] - rate * velocity[padded:])
        for cache in caches:  # copies its row's outputs at once (a replay's are overwritten by the next)
            cache.add_step(step, inputs.window, own)
    return [(x[i:i + 1, :, :count].float(), cache.cache) for i, (count, cache) in enumerate(zip(counts, caches))]


def _window(rows: Sequence[FlowRow], contexts: Sequence[int], step: int, width: int, x: torch.Tensor,
            out: Optional[torch.Tensor]) -> torch.Tensor:
    """The ODE state entering `step`: each row's conv context frames (left-padded with zeros to R) then its new
    frames x, (B, 80, R + N); written into `out` (a static buffer) when given."""
    left = x.new_zeros(x.shape[0], x.shape[1], width)
    for i, (row, context) in enumerate(zip(rows, contexts)):
        if context:
            left[i, :, width - context:] = row.cache.context[step][0]
    window = torch.cat([left, x], dim=2)
    return window if out is None else out.copy_(window)


class _RowCache:
    """Row i's cache as a solve builds it: its old cache plus, per step, the keys/values of its new frames up to
    the last complete chunk and the kept context frames of the step's window (a full-attention row keeps none)."""

    def __init__(self, row: FlowRow, i: int, batch: int, width: int, context: int, receptive: int,
                 chunk: int) -> None:
        """batch: the solve's (padded) rows; width: its context frames R."""
        self.row, self.i, self.batch = row, i, batch
        start = row.start
        commit = max(start, row.inputs.frames // chunk * chunk) if row.streaming and row.extend else 0
        self.keep, self.kept = max(commit - start, 0), min(commit, receptive)
        self.offset = width - context + commit - self.kept - (start - context)  # the kept context in a window
        self.cache = FlowCache(commit)

    def add_step(self, step: int, window: torch.Tensor, own: torch.Tensor) -> None:
        """own: the step's keys/values of every row's new frames (depth, 2, 2B, H, N, dim_head)."""
        if not (self.row.streaming and self.row.extend):
            return
        past = self.row.cache.kv[step] if self.row.cache.kv else None
        # the conditional rows then the unconditional ones: row i's pair is [i, batch + i]
        new = own[:, :, self.i::self.batch, :, :self.keep]
        self.cache.kv.append(new.clone() if past is None else past if self.keep == 0 else
                             torch.cat([past, new], dim=4))  # new tensors: caches are shared read-only
        self.cache.context.append(window[self.i:self.i + 1, :, self.offset:self.offset + self.kept].clone())


@dataclass(frozen=True)
class PendingChunk:
    """A computed chunk not yet applied to its stream (`CosyVoice3Stream.prepare` / `commit`)."""

    stream: "CosyVoice3Stream"
    chunk: Chunk
    mel: Optional[torch.Tensor]
    cache: Optional[FlowCache]
    audio: np.ndarray
    vocoder: VocoderState


class CosyVoice3Token2Wav:
    """Flow + causal HiFT; offline synthesis and streams.

    The batched flow solves replay the estimator's step graphs (`graphs`, `cosyvoice3.graphs`) once they are
    captured (`graphs.capture_all`), with buckets for this engine's own chunk schedule unless `use_graph_buckets`
    sets others, and the windowed vocoder's non-final calls replay its graphs (`vocoder_graphs`,
    `cosyvoice3.vocoder_graphs`) once those are captured, with buckets for the same schedule and rows; until then,
    and for calls outside the buckets, both run eagerly."""

    def __init__(self, flow: CosyVoice3Flow, hift: CausalHiFT, schedule: Optional[DiTChunkSchedule] = None,
                 voice_capacity: int = 8, cache_budget_bytes: Optional[int] = None,
                 windowed_vocoder: bool = True, final_over_cache: bool = False) -> None:
        """voice_capacity: voices whose prompt flow cache (`prompt_flow_cache`) is kept for cached streams, least
        recently used dropped first (each holds its committed prompt frames' keys/values: see docs).
        cache_budget_bytes: what the live cached streams' own flow caches may hold together (None: no limit; the
        voices' prompt caches, bounded by `voice_capacity`, are not counted); a stream whose next cache would pass
        it drops its cache and recomputes from then on (`CosyVoice3Stream.commit`).
        windowed_vocoder: a chunk vocodes a bounded window of its stream's mel (`CausalHiFT.stream_chunks`);
        False: the whole accumulated mel, as the reference does (the same samples up to float rounding).
        final_over_cache: a cached stream's final chunk also continues its flow cache under the chunk mask (only
        its new frames computed, within the step graphs' buckets); False: it recomputes the prompt and every token
        with full attention, as the reference (a whole call, outside the buckets: run eagerly)."""
        self.flow = flow
        self.windowed_vocoder = windowed_vocoder
        self.final_over_cache = final_over_cache
        self.frame_counts = FrameCounts()  # the streams' and offline jobs' batched solves (not the voices' caches)
        self.hift = hift
        self.voice_caches = VoiceCaches(voice_capacity)
        self.budget = CacheBudget(cache_budget_bytes)
        self.schedule = schedule or runtime_schedule(lookahead=flow.config.pre_lookahead_len)
        self.lookahead = flow.config.pre_lookahead_len
        self.graphs = FlowStepGraphs(flow.estimator, self.graph_buckets([self.schedule]))
        self.vocoder_graphs = WindowGraphs(hift, self.vocoder_buckets([self.schedule], self.graphs.buckets.rows))
        weight = flow.input_embedding.weight
        self.flow_device, self.flow_dtype = weight.device, weight.dtype
        self.hift_device = hift.stft_window.device

    def graph_buckets(self, schedules: Sequence[HopSchedule]) -> FlowGraphBuckets:
        """Step-graph buckets covering the non-final chunks of `schedules` (`cosyvoice3.graphs`), and their final
        chunks where those continue the flow caches (`final_over_cache`)."""
        return FlowGraphBuckets.covering(schedules, self.flow.config.token_mel_ratio,
                                         self.flow.estimator.config.static_chunk_size,
                                         final_chunks=self.final_over_cache)

    def vocoder_buckets(self, schedules: Sequence[HopSchedule], rows: Sequence[int] = ROW_BUCKETS) -> WindowBuckets:
        """Vocoder-graph buckets covering the non-final calls of `schedules`' streams, of up to max(rows) rows
        (`cosyvoice3.vocoder_graphs`)."""
        return WindowBuckets.covering(self.hift, schedules, self.flow.config.token_mel_ratio, rows)

    def use_graph_buckets(self, buckets: FlowGraphBuckets) -> None:
        """Replace the step graphs by an empty set with these buckets, and the vocoder graphs by an empty set for
        the engine's schedule with their rows (before capturing them)."""
        self.graphs = FlowStepGraphs(self.flow.estimator, buckets)
        self.vocoder_graphs = WindowGraphs(self.hift, self.vocoder_buckets([self.schedule], buckets.rows))

    def limit_flow_caches(self, budget_bytes: Optional[int]) -> None:
        """Replace the live cached streams' flow-cache budget (None: no limit) before any stream opens: a server
        sizes it beside the step graphs' planned buffers (`graphs.plan`)."""
        if self.budget.nbytes:
            raise RuntimeError("the flow-cache budget changes only before any stream holds caches")
        self.budget = CacheBudget(budget_bytes)

    def memory_plan(self) -> str:
        """What this engine holds or may hold beyond its weights, for the start-up log: the step graphs' shared
        static buffers (`StaticPlan`, allocated when they are captured; their pool adds about one pass of the
        largest bucket), the vocoder graphs' (likewise, with their own pool), the live cached streams' flow-cache
        budget, and the voices whose prompt caches are kept (bounded in number, not bytes: each holds its committed
        prompt frames' keys/values of every Euler step)."""
        dit = self.flow.estimator.config
        per_frame = len(self.flow.decoder.schedule) * dit.depth * 2 * 2 * dit.inner_dim * self.flow_dtype.itemsize
        budget = self.budget.budget_bytes
        streams = "no limit" if budget is None else f"{budget / 2**30:.2f} GiB at most"
        graphs = f"{len(self.graphs.buckets.shapes())} buckets): {self.graphs.plan(self.flow_dtype).describe()}"
        vocoder = self.vocoder_graphs
        vocoder_plan = f"{len(vocoder.shapes())} buckets): {vocoder.planned_bytes(torch.float32) / 2**30:.2f} GiB"
        return (f"flow step graphs ({graphs}; vocoder graphs ({vocoder_plan}; live streams' flow caches: {streams}; "
                f"prompt caches of up to {self.voice_caches.capacity} voices, {per_frame / 2**20:.2f} MiB per cached "
                "prompt frame")

    @property
    def sample_rate(self) -> int:
        return self.hift.config.sampling_rate

    @property
    def cache_bytes(self) -> int:
        """Bytes of the live streams' own flow caches (what the budget counts)."""
        return self.budget.nbytes

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
            return batched_solve(self.flow, [FlowRow(inputs, FlowCache(), streaming=True)])[0][1]

        return self.voice_caches.get(key, compute)  # type: ignore[arg-type, return-value]

    def open_stream(self, prompt: VoicePrompt, cached: bool = False) -> "CosyVoice3Stream":
        """cached: run non-final chunks over flow caches, starting from the voice's `prompt_flow_cache`."""
        return CosyVoice3Stream(self, prompt, self.prompt_flow_cache(prompt) if cached else None)

    def fits_graphs(self, row: FlowRow) -> bool:
        """Whether a solve of this row alone fits a bucket of the step graphs (none: every row runs eagerly anyway)."""
        return self.graphs is None or self.graphs.buckets.fit(1, row.new_frames, row.start) is not None

    @torch.inference_mode()
    def run_chunks(self, work: Sequence[tuple["CosyVoice3Stream", Chunk]]) -> list[np.ndarray]:
        """Run the next chunk of each stream and return each one's new audio. The chunks of cached streams (and
        offline jobs) share batched flow solves (`batched_solve`: one estimator pass per Euler step), one for the
        non-final chunks (chunk mask) and one for the final chunks and offline jobs (full attention); the vocoder
        runs per chunk; streams opened without a cache run the reference path one by one.
        All or nothing: the chunks are computed first and applied only when every one succeeded, so a call that
        raises leaves every stream as it was (a caller may retry each job alone)."""
        streams = [stream for stream, _ in work]
        if len({id(stream) for stream in streams}) != len(streams):
            raise ValueError("run_chunks takes at most one chunk per stream")
        for stream, chunk in work:
            stream.check_next(chunk)
        batched = [i for i, (stream, _) in enumerate(work) if stream.cached and stream.tokens]
        rows = {i: work[i][0].flow_row(work[i][1]) for i in batched}
        solved = {}
        # one solve per attention mode: final chunks and offline jobs (whole calls, often long) would otherwise pad
        # every short streaming row to their length; within a mode, the rows beyond every graph bucket apart
        for streaming in (True, False):
            group = [i for i in batched if rows[i].streaming == streaming]
            for part in fitting_first(group, lambda i: self.fits_graphs(rows[i])):
                solved.update(zip(part, batched_solve(self.flow, [rows[i] for i in part], self.graphs,
                                                      self.frame_counts)))
        mels: list[tuple[Optional[torch.Tensor], Optional[FlowCache]]] = []
        for i, (stream, chunk) in enumerate(work):
            if i in solved:
                mel, cache = solved[i]
                mels.append((stream.own_frames(chunk, rows[i], mel), cache))
            else:
                mels.append(stream.chunk_mel(chunk) if stream.tokens else (None, None))
        return [p.stream.commit(p) for p in self.vocode_chunks(work, mels)]

    def vocode_chunks(self, work: Sequence[tuple["CosyVoice3Stream", Chunk]],
                      mels: Sequence[tuple[Optional[torch.Tensor], Optional[FlowCache]]]) -> list[PendingChunk]:
        """Vocode each chunk's own mel (None: an empty stream) after its stream's earlier mel -> the chunks, not
        applied. Windowed: all rows in one `CausalHiFT.stream_chunks` (batched where the windows allow);
        otherwise the reference, one row at a time."""
        rows = [(stream.vocoder, mel.to(self.hift_device, torch.float32), chunk.final)
                for (stream, chunk), (mel, _) in zip(work, mels) if mel is not None]
        if self.windowed_vocoder:
            vocoded = self.hift.stream_chunks(rows, self.vocoder_graphs) if rows else []
        else:
            vocoded = [self.hift.reference_chunk(*row) for row in rows]
        # one copy to the host for the whole call
        host = torch.cat([audio for audio, _ in vocoded]).cpu().numpy() if vocoded else np.zeros(0, np.float32)
        results, offset = iter(vocoded), 0
        pending = []
        for (stream, chunk), (mel, cache) in zip(work, mels):
            if mel is None:
                pending.append(PendingChunk(stream, chunk, None, None, np.zeros(0, dtype=np.float32), stream.vocoder))
                continue
            audio, state = next(results)
            piece, offset = host[offset:offset + audio.shape[0]], offset + audio.shape[0]
            pending.append(PendingChunk(stream, chunk, mel.to(self.hift_device, torch.float32),
                                        None if chunk.final else cache, piece, state))
        return pending

    def offline_job(self, tokens: Sequence[int], prompt: VoicePrompt) -> tuple["CosyVoice3Stream", Chunk]:
        """A whole utterance as a one-chunk stream (a final chunk over all tokens: full attention, final vocoder
        call: the audio of `offline` up to float summation order), to run in `run_chunks` beside streaming chunks,
        its flow solved in the call's batch."""
        stream = CosyVoice3Stream(self, prompt, FlowCache())  # on the batched path; a final chunk reads no cache
        stream.extend(tokens)
        return stream, Chunk(0, len(stream.tokens), len(stream.tokens), final=True)


class CosyVoice3Stream(ChunkedStream):
    """All state of one stream: tokens, chunks run, the vocoder's state (the mel it still reads, samples sent),
    the optional flow cache.
    `extend` / `next_chunk` / `push` / `finish` as CosyVoice2's streams (`cosyvoice2.streaming.ChunkedStream`).

    A cached stream's own flow-cache bytes count against the engine's budget: each chunk's new cache is charged
    the difference to the one it replaces; the stream returns them all at its final chunk, at `close`, when the
    budget refuses a new cache (it then recomputes from there on) and when it is dropped (cancelled, expired)."""

    def __init__(self, engine: CosyVoice3Token2Wav, prompt: VoicePrompt, flow_cache: Optional[FlowCache] = None) -> None:
        """flow_cache: where the cached flow path starts (None: every chunk recomputes, the reference path)."""
        self.engine = engine
        self.prompt = prompt
        self.schedule = engine.schedule
        self.tokens: list[int] = []
        self.chunks: list[Chunk] = []
        self.finished = False
        self.cached = flow_cache is not None  # cleared when the budget refuses the stream's next cache, or at close
        self.flow_cache = flow_cache
        # the tensors of `flow_cache` this stream made (id -> bytes; alive while it holds them); the rest are
        # shared with the voice's prompt cache and are the voice's
        self._own: dict[int, int] = {}
        self._flow_cache_bytes = 0  # sum of `_own`, as accounted in the engine's budget
        self.vocoder: VocoderState = engine.hift.stream_start()
        self.last_mel: Optional[torch.Tensor] = None  # the last chunk's own mel frames (1, 80, n)

    def check_next(self, chunk: Chunk) -> None:
        if self.finished:
            raise RuntimeError("the stream already ran its final chunk")
        if chunk.start != self._start or not chunk.start <= chunk.stop <= chunk.feed <= len(self.tokens):
            raise CosyVoice3InputError(f"{chunk} does not continue the stream (at token {self._start} of "
                                       f"{len(self.tokens)})")
        if not chunk.final and chunk.feed - chunk.stop != self.engine.lookahead:
            raise CosyVoice3InputError(f"a non-final chunk carries exactly {self.engine.lookahead} lookahead tokens")

    def flow_row(self, chunk: Chunk) -> FlowRow:
        """This chunk's row of a batched flow solve (cached streams): a non-final chunk continues the stream's
        flow cache under the chunk mask; the final chunk is a whole call with full attention (nothing carries
        over), unless the engine's `final_over_cache` continues the cache for it too (a final chunk that is the
        stream's first, an offline job among them, stays a whole call: it has no cache of its own to continue)."""
        inputs = self.engine.flow_inputs(self.tokens[: chunk.feed], self.prompt, finalize=chunk.final)
        if chunk.final and not (self.engine.final_over_cache and chunk.start > 0):
            return FlowRow(inputs, FlowCache(), streaming=False)
        if self.flow_cache is None:
            raise RuntimeError("a stream without a flow cache runs the reference path (`chunk_mel`)")
        return FlowRow(inputs, self.flow_cache, streaming=True, extend=not chunk.final)

    def own_frames(self, chunk: Chunk, row: FlowRow, mel: torch.Tensor) -> torch.Tensor:
        """The frames of tokens [start, stop) (final: [start, end)) among a solve's frames [row.start, T)."""
        ratio = self.engine.flow.config.token_mel_ratio
        return mel[:, :, row.inputs.prompt_frames + ratio * chunk.start - row.start:]

    def chunk_mel(self, chunk: Chunk) -> tuple[torch.Tensor, Optional[FlowCache]]:
        """The mel frames of tokens [start, stop) (final: [start, end)) of this chunk, (1, 80, frames), and the
        flow cache after it (None without one, or after the final chunk). Changes nothing in the stream."""
        if self.cached:
            row = self.flow_row(chunk)
            mel, cache = batched_solve(self.engine.flow, [row], self.engine.graphs, self.engine.frame_counts)[0]
            return self.own_frames(chunk, row, mel), None if chunk.final else cache
        ratio = self.engine.flow.config.token_mel_ratio
        mel = self.engine.mel(self.tokens[: chunk.feed], self.prompt, streaming=not chunk.final,
                              finalize=chunk.final)
        return mel[:, :, ratio * chunk.start:], None

    def prepare(self, chunk: Chunk) -> "PendingChunk":
        """Compute `chunk` (the schedule's next one) without changing the stream; `commit` applies it."""
        self.check_next(chunk)
        mel = self.chunk_mel(chunk) if self.tokens else (None, None)  # an empty stream: nothing to vocode
        return self.engine.vocode_chunks([(self, chunk)], [mel])[0]

    def commit(self, pending: "PendingChunk") -> np.ndarray:
        if pending.mel is not None:
            self.last_mel = pending.mel
        self.vocoder = pending.vocoder
        self._keep_flow_cache(None if pending.chunk.final else pending.cache)
        self.chunks.append(pending.chunk)
        self.finished = pending.chunk.final
        return pending.audio

    def _keep_flow_cache(self, cache: Optional[FlowCache]) -> None:
        """Replace the stream's flow cache by the one its chunk built, charging the budget the difference of the
        stream's own bytes (a chunk that completes no new 50-frame chunk keeps the old keys/values, possibly the
        voice's); a cache the budget refuses is dropped and the stream takes the reference path from then on (the
        same audio up to float rounding, only slower). Never raises: `run_chunks` applies its chunks after all of
        them were computed."""
        if cache is None:  # the final chunk, or a stream on the reference path
            self.release_flow_cache()
            return
        old = {id(tensor) for tensor in self.flow_cache.tensors()} if self.flow_cache is not None else set()
        own = {id(tensor): tensor.nbytes for tensor in cache.tensors()
               if id(tensor) not in old or id(tensor) in self._own}
        nbytes = sum(own.values())
        if self.engine.budget.reserve(nbytes - self._flow_cache_bytes):
            self.flow_cache, self._own, self._flow_cache_bytes = cache, own, nbytes
        else:  # over budget: recompute from here on
            self.close()

    def release_flow_cache(self) -> None:
        """Drop the stream's flow cache and return its own bytes to the engine's budget."""
        self.flow_cache, self._own = None, {}
        if self._flow_cache_bytes:
            self.engine.budget.release(self._flow_cache_bytes)
            self._flow_cache_bytes = 0

    def close(self) -> None:
        """Free the stream's flow cache (a cancelled stream); a chunk run after this recomputes."""
        self.release_flow_cache()
        self.cached = False

    def __del__(self) -> None:  # a stream dropped mid-utterance (cancelled, expired) returns its budget
        try:
            self.release_flow_cache()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @torch.inference_mode()
    def run(self, chunk: Chunk) -> np.ndarray:
        """Run `chunk` (the schedule's next one) and return its new audio; if it raises, the stream is unchanged."""
        return self.commit(self.prepare(chunk))

    def audio(self, tokens: Iterable[int]) -> np.ndarray:
        """Convenience: push all `tokens`, finish, and return the whole stream's audio."""
        pieces = self.push(tokens)
        pieces.append(self.finish())
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
