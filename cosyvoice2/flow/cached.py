"""Chunk-cached streaming flow: a streaming chunk costs in proportion to its new frames, not to its history.

Why this is exact. In a streaming (non-final) flow call every layer is causal at the granularity of the attention
chunk grid (25 tokens in the encoder, 50 frames in its up layers and in the estimator): attention sees only keys of
the same or earlier chunks, the convolutions are causal (the lookahead layer reads 3 tokens ahead, which the
chunk schedule always supplies), and the ODE's start noise is indexed by absolute frame. Every non-final chunk of
the schedule ends on the grid, so the hidden states of all earlier frames - in every encoder layer, and in every
estimator layer at every Euler step for both guidance rows - are identical in a later, longer call. Keeping them
(attention keys/values, the last inputs of each causal conv) and running the network over the new frames only
gives the same mel as recomputing the whole prefix, up to float summation order.

What is not exact: upstream's final chunk uses *full* attention, so there every earlier frame also sees the
final frames and all hidden states change. `CachedFlowState` therefore offers two ways to finish a stream: run the
final chunk over the caches with chunk attention (cheap; earlier frames keep their chunk-causal states; measured
deviation in docs/engine.md), or recompute it in full like the uncached path (exact).

The voice prompt's share of the work is done once per voice (`prefix`): the part of the prompt that lies on whole
grid chunks and whose lookahead context is prompt too. A stream starts from that prefix and shares its caches.

Layout of the caches (per stream, one tensor per kind, appended per chunk along the frame axis):
- encoder: keys/values of each conformer layer over tokens, and of each up layer over frames; the last 2 token
  states before upsampling (the upsampling conv's left context);
- estimator: per Euler step one tensor (blocks, k/v, guidance row, frames, heads, head_dim) - frames before heads,
  the layout the projections produce, so that a row's keys/values of a run of frames are one contiguous block - and
  the last 2 input frames of each causal conv (per step, per conv, guidance row).

Rows of different histories and lengths run in one batched call: histories and new frames are right-padded and
masked, as in `CausalFlow.inference_batch`.

A call's rows run their Euler steps in lock step (`advance`, one estimator evaluation of every row per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from speech_lm.graph_buckets import GridGraphs, fitting_first
from speech_lm.kernels import copy_runs
from ..host_copies import to_device
from .cached_encoder import CachedEncoder, EncoderCache
from .estimator import CausalBlock1D, CausalResnetBlock1D, TransformerBlock, _MASKED_BIAS

CONV_CONTEXT = 2  # every causal conv of the estimator has kernel 3

# The estimator's CUDA-graph buckets. A call's rows run padded to the bucket (rows, longest row's new frames, longest
# history), so every padded frame-row is computed at every Euler step. Rows: every count up to 4, then steps of a
# half (6, 12) between the powers of two, so a call of 5, 9 or 10 rows no longer pays for 8 or 16 (with rows
# 1/2/4/8/16, 53-61 % of the estimator's frame-rows were padding from 16 streams on, on an H100). New frames: the
# chunks of the served schedules are whole 25-token grid chunks, 50 frames each (a second chunk 100 frames, every
# later one 200), so the buckets sit at 50-frame steps from 104 (a first chunk: 25 tokens + the prompt's tail) to
# 256 (the encoder's longest call, 128 tokens); 128/256 padded the common 100- and 200-frame chunks by 22-28 %.
STEP_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
STEP_NEW_FRAMES = (104, 152, 200, 256)
STEP_HISTORY_FRAMES = (256, 512, 768, 1024, 1280, 1536, 2048)


# ---- state ---------------------------------------------------------------------------------------------
@dataclass
class EstimatorCache:
    frames: int = 0
    kv: list[torch.Tensor] = field(default_factory=list)  # per step: (blocks, 2, 2 rows, frames, heads, head_dim)
    tails: list[torch.Tensor] = field(default_factory=list)  # per step: (2 rows, channels of all causal convs, 2)


@dataclass
class CachedSegment:
    """Caches of a run of frames: the shared voice prefix, or what one stream added after it."""

    encoder: EncoderCache = field(default_factory=EncoderCache)
    estimator: EstimatorCache = field(default_factory=EstimatorCache)

    def tensors(self) -> list[torch.Tensor]:
        tensors = [self.encoder.kv, self.encoder.up_kv, self.encoder.up_tail, *self.estimator.kv,
                   *self.estimator.tails]
        return [t for t in tensors if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class CachedRow:
    """One row of a cached flow call.

    `tokens` holds the row's whole token sequence (prompt first) up to at least `stop` (+ lookahead when not
    final); the call encodes tokens[start:stop] where start = prefix + own cached tokens (on the grid), returns
    the mel of tokens[emit_from:stop], and, when `keep`, caches the states of the whole grid chunks it completed:
    a chunk that ends off the grid (a first hop that is not a multiple of 25) leaves its partial grid chunk to be
    recomputed by the next call, exactly as the uncached path recomputes it.
    """

    tokens: torch.Tensor  # (T,) int64: prompt tokens then generated tokens
    prompt_mel: torch.Tensor  # (2P, 80) the prompt's mel (cond)
    spks: torch.Tensor  # (80,) projected speaker embedding
    prefix: CachedSegment  # shared (voice) caches; read only
    own: CachedSegment  # this stream's caches after the prefix; appended when `keep`
    stop: int  # one past the last token encoded in this call (absolute, prompt included)
    final: bool  # no lookahead context (zeros), full attention among the new frames
    keep: bool  # append this call's caches to `own` (a non-final chunk)
    emit_from: int = -1  # first token whose mel is returned (absolute; default: the prompt's end)

    @property
    def start(self) -> int:
        return self.prefix.encoder.tokens + self.own.encoder.tokens

    def kept_tokens(self, grid: int) -> int:
        """Tokens of this call whose states are cached afterwards (whole grid chunks; 0 unless `keep`)."""
        return (self.stop // grid * grid - self.start) if self.keep and not self.final else 0

    def first_emitted(self) -> int:
        return max(self.emit_from, self.prompt_mel.size(0) // 2, self.start)


@dataclass(eq=False)
class SolvingRow:
    """A cached row of a call during its Euler solve: its encoder output and the ODE state, advanced one step at
    a time (`advance`) with the call's other rows."""

    row: CachedRow
    mu: torch.Tensor  # (80, new) encoder output of the new frames
    x: torch.Tensor  # (80, new) the ODE state after `step` steps
    cond: torch.Tensor  # (80, new) prompt mel frames inside the call, zeros elsewhere
    spks: torch.Tensor  # (80,)
    start: int  # first new frame (absolute) = history frames
    new: int  # new frames
    kept: int  # frames whose estimator states are cached afterwards
    step: int = 0  # Euler steps done
    kv: list[torch.Tensor] = field(default_factory=list)  # per step done: (blocks, 2, 2 rows, kept, heads, d)
    tails: list[torch.Tensor] = field(default_factory=list)  # per step done: (2 rows, channels, 2)

    def done(self, steps: int) -> bool:
        return self.step >= steps


@dataclass(eq=False)
class StepBatch:
    """The step-invariant padded inputs of one set of rows (`CachedFlowRunner.step_batch`); rebuilt when the
    set of rows changes, reused while it does not (the attention bias is the costly part)."""

    rows: tuple[SolvingRow, ...]
    shape: Optional[tuple[int, int, int]]  # the CUDA-graph bucket, or None (eager)
    padded: tuple[int, int, int]  # (rows, new frames, history frames) after padding
    mask: torch.Tensor  # (2 Bp, 1, N) guidance rows stacked: conditional, then unconditional
    mu: torch.Tensor
    spks: torch.Tensor
    cond: torch.Tensor
    bias: torch.Tensor
    tail_at: torch.Tensor


def _cat(a: Optional[torch.Tensor], b: torch.Tensor, dim: int) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=dim)


def _kept(kv: torch.Tensor, tails: torch.Tensor, solving: Sequence["SolvingRow"], rows_p: int
          ) -> list[Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row, what it caches of a step: its first `kept` new frames' keys/values of both guidance rows (blocks, 2,
    2, kept, heads, d) and its conv tails (2, channels, 2), or None (a row that keeps nothing), out of the step's
    new keys/values (blocks, 2, 2 Bp, N, heads, d) and tails (2 Bp, channels, 2).

    One copy of every real row's frames together, not two per row: each copy is a kernel launched from Python, and
    this runs at every Euler step while the LLM's thread waits for the same interpreter lock. The padding rows are
    left out (the step's guidance rows are (2, Bp): the first `len(solving)` of each), and a row's cache is a view
    of the copy until `CachedFlowRunner.commit` makes it contiguous."""
    longest, count = max(s.kept for s in solving), len(solving)
    if not longest:
        return [None] * count
    source = kv.unflatten(2, (2, rows_p))[:, :, :, :count, :longest]  # (blocks, 2, 2, B, longest, heads, d)
    frames = source.new_empty(source.shape)
    copy_runs(frames, source)
    kept_tails = tails.unflatten(0, (2, rows_p))[:, :count].clone()  # (2, B, channels, 2)
    return [(frames[:, :, :, b, : s.kept], kept_tails[:, b]) if s.kept else None for b, s in enumerate(solving)]


def _consecutive(values: list[int]) -> bool:
    return values == list(range(values[0], values[0] + len(values)))


# ---- the cached forward ----------------------------------------------------------------------------------
class CachedFlowRunner:
    """Runs `CausalFlow` over new frames with caches. Stateless apart from the flow; any number of streams."""

    def __init__(self, flow: torch.nn.Module, graphs: bool = True, packed: bool = False) -> None:
        """`packed`: solve a call's rows on one frame axis (`flow.packed`, no padding to the longest row or
        history) instead of padded to the step graphs' buckets."""
        self.flow = flow
        # new frames x rows of every set of rows the estimator ran over: needed, and computed (with the padding
        # up to a graph bucket); their ratio is the padding's share of the estimator's work. Of the padding, the
        # frames of whole padding rows (the rows bucket) apart from the short rows' padding to the longest row.
        self.frames_needed = 0
        self.frames_computed = 0
        self.frames_padding_rows = 0
        # attention's query x key frames (new x (history + new), per row): needed alone, and computed, every row
        # padded to the longest row's new frames and the history bucket
        self.attention_needed = 0
        self.attention_computed = 0
        # CUDA graphs of one estimator evaluation per shape bucket (used for CUDA tensors only)
        self.graphs: Optional[StepGraphs] = StepGraphs(self) if graphs and not packed else None
        # the encoder pass (once per call), from CUDA graphs of its own buckets (`cached_encoder.EncoderGraphs`)
        self.encoder = CachedEncoder(flow, graphs, row_buckets=self.graphs.rows if self.graphs is not None else STEP_ROWS)
        self.config = flow.config
        self.fused = _FusedWeights.of(flow.decoder.estimator)
        from .packed import PackedFlow  # it builds on this module

        self.packed: Optional[PackedFlow] = PackedFlow(self, graphs) if packed else None
        self.stride = flow.config.token_mel_ratio
        self.lookahead = flow.config.pre_lookahead_len
        self.grid = flow.config.encoder.static_chunk_size

    # -- prompt prefix ---------------------------------------------------------------------------------
    def prefix_tokens(self, prompt_tokens: int) -> int:
        """Prompt tokens whose states depend on the prompt alone: whole grid chunks whose lookahead is prompt."""
        return max(0, prompt_tokens - self.lookahead) // self.grid * self.grid

    @torch.inference_mode()
    def prefix(self, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor, spks: torch.Tensor) -> CachedSegment:
        """The shared caches of a voice prompt (prompt_tokens (P,), prompt_mel (2P, 80), spks (80,))."""
        segment = CachedSegment()
        n = self.prefix_tokens(prompt_tokens.numel())
        if n:
            row = CachedRow(prompt_tokens, prompt_mel, spks, CachedSegment(), segment, stop=n, final=False, keep=True,
                           emit_from=n)
            self.run([row])
        return segment

    def project_speaker(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(B, 192) x-vectors -> (B, 80), as the flow does before the estimator."""
        return self.flow.spk_embed_affine_layer(F.normalize(embeddings, dim=1))

    # -- one batched call ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, rows: Sequence[CachedRow]) -> list[torch.Tensor]:
        """`run_pending`, committing each row's new caches at once."""
        mels, updates = self.run_pending(rows)
        for row, update in zip(rows, updates):
            self.commit(row.own, update)
        return mels

    @torch.inference_mode()
    def run_pending(self, rows: Sequence[CachedRow]) -> tuple[list[torch.Tensor], list[Optional[CachedSegment]]]:
        """Mel (80, frames) float32 of tokens[first_emitted:stop] per row, and the caches each row's call adds
        (None when it keeps nothing), to `commit` once the chunk is delivered: a failed chunk changes no stream."""
        self._check(rows)
        mels: list[Optional[torch.Tensor]] = [None] * len(rows)
        updates: list[Optional[CachedSegment]] = [None] * len(rows)
        for group in self.graph_groups(rows):
            part = [rows[i] for i in group]
            mu, enc_out = self._encode(part)
            mel, est_out = self._solve(part, mu)
            for i, m, enc, est in zip(group, mel, enc_out, est_out):
                mels[i], updates[i] = m, CachedSegment(enc, est) if enc.tokens else None
        return mels, updates  # type: ignore[return-value]

    def graph_groups(self, rows: Sequence[CachedRow]) -> list[list[int]]:
        """Indices of the rows that fit the CUDA-graph buckets, then (a pass of their own, eager) of those that do
        not (`fitting_first`; without graphs every row is one eager pass)."""
        return fitting_first(range(len(rows)), lambda i: self.fits_graphs(rows[i]))

    @property
    def solve_graphs(self):
        """The CUDA graphs of the Euler solve (padded step graphs, or the packed ones), or None."""
        return self.packed.graphs if self.packed is not None else self.graphs

    @property
    def max_rows(self) -> Optional[int]:
        """Rows per call that the solve's graphs take at most (None without graphs)."""
        if self.packed is not None:
            return self.packed.graphs.row_count if self.packed.graphs is not None else None
        return max(self.graphs.rows) if self.graphs is not None else None

    def fits_graphs(self, row: CachedRow) -> bool:
        """Whether a call of this row alone fits a bucket of the estimator's graphs and (where it has any) of the
        encoder's."""
        new, history = (row.stop - row.start) * self.stride, row.start * self.stride
        if self.packed is not None:
            if not self.packed.fits_graphs(new, history):
                return False
        elif self.graphs is None or self.graphs.bucket(1, new, history) is None:
            return False
        new, history = row.stop - row.start, row.start
        encoder = self.encoder.graphs
        return encoder is None or encoder.bucket(1, new, history) is not None

    def _check(self, rows: Sequence[CachedRow]) -> None:
        for row in rows:
            if row.start % self.grid:
                raise ValueError(f"cached flow rows must start on the {self.grid}-token grid, not {row.start}")
            need = row.stop + (0 if row.final else self.lookahead)
            if not row.start < row.stop or row.tokens.numel() < need:
                raise ValueError(f"cached flow row needs tokens [{row.start}, {need}), has {row.tokens.numel()}")

    # -- encoder -----------------------------------------------------------------------------------------
    def _encode(self, rows: Sequence[CachedRow]) -> tuple[torch.Tensor, list[EncoderCache]]:
        """The encoder pass over the rows' new tokens (`cached_encoder`: replayed from a CUDA graph where the call
        fits a bucket): mu (rows, 80, frames) and the encoder caches each row keeps."""
        return self.encoder.run(rows)

    # -- estimator: the Euler solve ---------------------------------------------------------------------------
    def _solve(self, rows: Sequence[CachedRow], mu: torch.Tensor) -> tuple[list[torch.Tensor], list[EstimatorCache]]:
        """All Euler steps of a batch of rows (one whole call): the rows advance in lock step."""
        if self.packed is not None:
            return self.packed.solve(rows, mu)
        solving = self._begin(rows, mu)
        batch = self.step_batch(solving)
        for _ in self.flow.decoder.schedule:
            self.advance(solving, batch)
        results = [self.result(s) for s in solving]
        return [mel for mel, _ in results], [est for _, est in results]

    def _begin(self, rows: Sequence[CachedRow], mu: torch.Tensor) -> list["SolvingRow"]:
        cfm = self.flow.decoder
        device, dtype = mu.device, mu.dtype
        out = []
        for b, row in enumerate(rows):
            start, new = row.start * self.stride, (row.stop - row.start) * self.stride
            hist = row.prefix.estimator.frames + row.own.estimator.frames
            if hist != start:
                raise RuntimeError("encoder and estimator caches disagree")
            if start + new > cfm.rand_noise.size(-1):
                raise ValueError("flow call exceeds the fixed-noise buffer")
            x = cfm.rand_noise[0, :, start : start + new].to(device, dtype)  # noise indexed by absolute frame
            cond = torch.zeros_like(x)
            prompt = row.prompt_mel[start : start + new]  # prompt frames inside this call (cond), if any
            if prompt.size(0):
                cond[:, : prompt.size(0)] = prompt.transpose(0, 1).to(dtype)
            out.append(SolvingRow(row, mu[b, :, :new], x, cond, row.spks.to(dtype), start, new,
                                  row.kept_tokens(self.grid) * self.stride))
        return out

    def step_batch(self, solving: Sequence["SolvingRow"]) -> "StepBatch":
        """The padded inputs of one estimator evaluation over `solving` that do not change from step to step
        (mask, mu, cond, speaker, attention bias, conv-tail positions): built once per set of rows."""
        estimator = self.flow.decoder.estimator
        batch = len(solving)
        like = solving[0].x
        device, dtype = like.device, like.dtype
        news = [s.new for s in solving]
        hist = [s.start for s in solving]
        # shapes: on CUDA padded to a captured bucket (rows, new frames, history frames), else as they come
        use_graphs = self.graphs is not None and (like.is_cuda or self.graphs.emulate)
        shape = self.graphs.bucket(batch, max(news), max(hist)) if use_graphs else None
        rows_p, longest, hist_p = shape or (batch, max(news), max(hist))
        # what the estimator computes for these rows (padded to the bucket) against what they need
        pad = rows_p - batch
        self.frames_needed += sum(news)
        self.frames_computed += rows_p * longest
        self.frames_padding_rows += pad * longest
        self.attention_needed += sum(n * (h + n) for n, h in zip(news, hist))
        self.attention_computed += rows_p * longest * (hist_p + longest)
        news_p = news + [0] * pad
        mask = (torch.arange(longest, device=device) < to_device(news_p, device).unsqueeze(1))
        mask = mask.unsqueeze(1).to(dtype)  # (Bp, 1, longest)
        mu = like.new_zeros(rows_p, like.size(0), longest)
        cond = torch.zeros_like(mu)
        for b, s in enumerate(solving):
            mu[b, :, : s.new] = s.mu
            cond[b, :, : s.new] = s.cond
        mu = mu * mask
        spks = F.pad(torch.stack([s.spks for s in solving]), (0, 0, 0, pad))
        finals = [s.row.final for s in solving] + [True] * pad
        bias = self._estimator_bias(finals, hist + [0] * pad, news_p, hist_p, longest,
                                    estimator.config.static_chunk_size, device, dtype)
        kept_p = [s.kept for s in solving] + [0] * pad
        tail_at = to_device(kept_p * 2, device).view(-1, 1, 1) + torch.arange(CONV_CONTEXT, device=device)
        return StepBatch(tuple(solving), shape, (rows_p, longest, hist_p), torch.cat([mask, mask]),
                         torch.cat([mu, torch.zeros_like(mu)]), torch.cat([spks, torch.zeros_like(spks)]),
                         torch.cat([cond, torch.zeros_like(cond)]), bias, tail_at)

    @torch.inference_mode()
    def advance(self, solving: Sequence["SolvingRow"], batch: Optional["StepBatch"] = None) -> "StepBatch":
        """One Euler step for every row (all at the same step index: a call's rows advance in lock step), in one
        padded estimator evaluation. `batch` (from `step_batch` over the same rows) is reused when given; returns
        the batch used. Nothing changes unless the whole step succeeds."""
        if batch is None or batch.rows != tuple(solving):
            batch = self.step_batch(solving)
        cfm = self.flow.decoder
        schedule = cfm.schedule
        step = solving[0].step
        if any(s.step != step for s in solving):
            raise ValueError("advance: the rows of a call run their Euler steps in lock step")
        if step >= len(schedule):
            raise ValueError("advance: the rows have already run every Euler step")
        rows_p, longest, hist_p = batch.padded
        count = len(solving)
        like = solving[0].x
        device, dtype = like.device, like.dtype
        x = like.new_zeros(rows_p, like.size(0), longest)
        for b, s in enumerate(solving):
            x[b, :, : s.new] = s.x
        steps = [step] * count
        rows = [s.row for s in solving]
        t_in = torch.full((2 * rows_p,), schedule[step][0], device=device, dtype=dtype)
        x_in = torch.cat([x, x])
        if batch.shape is not None:
            velocity, kv, new_tails = self.graphs.run(batch.shape, rows, steps, x_in, batch.mask, batch.mu, t_in,
                                                      batch.spks, batch.cond, batch.bias, batch.tail_at)
        else:
            keys = self._key_buffer(like, rows_p, hist_p + longest)
            self._gather_history(rows, steps, hist_p, rows_p, out=keys[:, :, :, :hist_p])
            tails = self._gather_tails(rows, steps, rows_p)
            velocity, kv, new_tails = self.estimate(x_in, batch.mask, batch.mu, t_in, batch.spks, batch.cond,
                                                    batch.bias, keys, hist_p, tails, batch.tail_at)
        rate = cfm.config.inference_cfg_rate
        v_cond, v_uncond = velocity[:rows_p], velocity[rows_p:]
        x = x + schedule[step][1] * ((1.0 + rate) * v_cond - rate * v_uncond)  # the scalar dt, as the uncached solver
        # keep what the rows cache (graph outputs are overwritten by the next replay; strided slices: an index list
        # would be a host-to-device copy, i.e. a sync, per row and step)
        kept = _kept(kv, new_tails, solving, rows_p)
        for b, s in enumerate(solving):  # commit the step to every row at once, after all of it succeeded
            s.x = x[b, :, : s.new]
            s.step += 1
            if kept[b] is not None:
                s.kv.append(kept[b][0])
                s.tails.append(kept[b][1])
        return batch

    def result(self, s: "SolvingRow") -> tuple[torch.Tensor, EstimatorCache]:
        """A finished row's mel (80, frames) float32 of tokens[first_emitted:stop] and its new estimator caches."""
        if not s.done(len(self.flow.decoder.schedule)):
            raise ValueError("result: the row has Euler steps left")
        skip = s.row.first_emitted() * self.stride - s.start
        mel = s.x[:, skip : s.new].float()
        return mel, EstimatorCache(s.kept, s.kv, s.tails) if s.kept else EstimatorCache()

    @staticmethod
    def _estimator_bias(finals, hist, news, hist_p, longest, chunk, device, dtype) -> torch.Tensor:
        """(2B, 1, longest, hist_p + longest) additive bias: history keys (padded to hist_p), then new keys
        (chunk-causal unless final)."""
        slot = torch.arange(hist_p + longest, device=device)
        hist_t = to_device(hist, device)
        news_t = to_device(news, device)
        is_new = slot >= hist_p
        new_index = slot - hist_p
        real = torch.where(is_new.unsqueeze(0), new_index.unsqueeze(0) < news_t.unsqueeze(1),
                           slot.unsqueeze(0) < hist_t.unsqueeze(1))  # (B, total)
        query = torch.arange(longest, device=device)
        # new frames start on the chunk grid (hist is a multiple of the chunk), so chunk ids compare locally
        later_chunk = is_new.view(1, 1, -1) & ((new_index // chunk).view(1, 1, -1) > (query // chunk).view(1, -1, 1))
        finals_t = to_device(finals, device).view(-1, 1, 1)
        visible = real.unsqueeze(1) & (~later_chunk | finals_t)  # (B, Nq, total)
        bias = (1.0 - visible.to(dtype)) * _MASKED_BIAS
        return torch.cat([bias, bias]).unsqueeze(1)

    def _gather_history(self, rows: Sequence[CachedRow], steps: Sequence[int], hist_p: int, rows_p: int,
                        out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """(blocks, 2, 2 Bp, hist_p, heads, d) keys/values of every row's history at its own Euler step
        (`steps[b]`), written into `out` when given (padding left as it is: masked). Rows sharing a voice prefix
        and a step get it in one copy."""
        if hist_p == 0:
            return out
        if out is None:
            like = next(seg.estimator.kv[step] for row, step in zip(rows, steps) for seg in (row.prefix, row.own)
                        if seg.estimator.frames)
            blocks, _, _, _, heads, head_dim = like.shape
            out = like.new_zeros(blocks, 2, 2 * rows_p, hist_p, heads, head_dim)
        by_prefix: dict[tuple[int, int], list[int]] = {}
        for b, row in enumerate(rows):
            if row.prefix.estimator.frames:
                by_prefix.setdefault((id(row.prefix), steps[b]), []).append(b)
        # every copy moves contiguous (frames x heads x head_dim) runs: `copy_runs`, not PyTorch's generic copy
        for (_, step), members in by_prefix.items():
            piece = rows[members[0]].prefix.estimator.kv[step]  # (blocks, 2, 2, n, heads, d)
            n = piece.size(3)
            for cfg in (0, 1):
                target = [b + cfg * rows_p for b in members]
                if _consecutive(target):  # one broadcast copy for all rows of this voice
                    copy_runs(out[:, :, target[0] : target[-1] + 1, :n], piece[:, :, cfg : cfg + 1])
                else:
                    for b in target:
                        copy_runs(out[:, :, b, :n], piece[:, :, cfg])
        for b, row in enumerate(rows):
            if row.own.estimator.frames:
                at = row.prefix.estimator.frames
                piece = row.own.estimator.kv[steps[b]]  # (blocks, 2, 2 guidance rows, n, heads, d)
                n = piece.size(3)
                copy_runs(out[:, :, b::rows_p, at : at + n], piece)  # guidance rows b and Bp + b in one copy
        return out

    def _gather_tails(self, rows: Sequence[CachedRow], steps: Sequence[int], rows_p: int,
                      out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """(2 Bp, channels of all causal convs, 2): the last inputs before each row's history end at its own
        Euler step (zeros for a row with no history)."""
        sources = []
        for row, step in zip(rows, steps):
            seg = row.own if row.own.estimator.frames else row.prefix
            sources.append(seg.estimator.tails[step] if seg.estimator.frames else None)
        if out is None:
            like = next((s for s in sources if s is not None), None)
            if like is None:
                return None
            out = like.new_zeros(2 * rows_p, *like.shape[1:])
        for b, source in enumerate(sources):  # guidance rows b and Bp + b
            if source is None:
                out[b::rows_p].zero_()
            else:
                out[b::rows_p] = source
        return out

    def _key_buffer(self, like: torch.Tensor, rows_p: int, frames: int) -> torch.Tensor:
        """A zeroed (blocks, 2, 2 Bp, frames, heads, d) key/value buffer (eager calls)."""
        cfg = self.flow.decoder.estimator.config
        blocks = len(self.flow.decoder.estimator.down_blocks[0][1]) * (2 + len(self.flow.decoder.estimator.mid_blocks))
        return like.new_zeros(blocks, 2, 2 * rows_p, frames, cfg.num_heads, cfg.attention_head_dim)

    def estimate(self, x, mask, mu, t, spks, cond, bias, keys, hist_p, tails, tail_at):
        """One estimator evaluation over new frames -> (velocity, this step's new k/v (blocks, 2, 2B, N, heads, d),
        new conv tails (2B, channels, 2) taken at `tail_at`). `keys` (blocks, 2, 2B, hist_p + N, heads, d) holds
        the history in its first hist_p frames; the new keys/values are written after them, so attention reads
        one buffer and the new ones are a view of it. Static shapes, no host syncs: CUDA-graph safe.

        The activations stay time-major, (2B, N, channels), from the first layer to the last, unlike the module's
        own forward (channels first around every conv, time-major in the transformer blocks). Flipping between
        the two made every LayerNorm, Mish, mask and conv input a strided copy, about a fifth of a step's GPU
        time; time-major, the causal convs are one GEMM over three stacked frames (`_ConvTails.conv`)."""
        convs = _ConvTails(tails, tail_at)
        blocks = _BlockKV(keys, hist_p, self.fused.qkv, bias)
        velocity = self.network(x, mask, mu, t, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond, convs, blocks)
        return velocity, blocks.collected(), convs.collected()

    def network(self, x, mask, mu, t, spks, cond, convs, blocks) -> torch.Tensor:
        """The estimator's layers over time-major activations -> velocity (rows, 80, frames): x, mu, spks, cond
        (rows, 80, frames), mask (rows, 1, frames), t (rows,). What makes it a cached evaluation is passed in:
        `convs` (`conv(module, x)`: causal convs with their left context) and `blocks` (`run(block, x)`:
        transformer blocks attending to their history); `estimate` gives them padded rows, `flow.packed` rows
        packed on one frame axis."""
        est = self.flow.decoder.estimator
        temb = est.time_mlp(est.time_embeddings(t).to(t.dtype))
        tembs = iter(self.fused.time_projections(temb))
        mask = mask.transpose(1, 2)  # (rows, frames, 1)
        h = torch.cat([x, mu, spks, cond], dim=1).transpose(1, 2)

        down = est.down_blocks[0]
        skip = self._stage(down, h, mask, next(tembs), convs, blocks)
        h = convs.conv(down[2], skip * mask)
        for stage in est.mid_blocks:
            h = self._stage(stage, h, mask, next(tembs), convs, blocks)
        up = est.up_blocks[0]
        h = self._stage(up, torch.cat([h, skip], dim=2), mask, next(tembs), convs, blocks)
        h = convs.conv(up[2], h * mask)
        h = self._block(est.final_block, h * mask, mask, convs)
        velocity = _pointwise(est.final_proj, h) * mask  # h is masked: the block's output
        return velocity.transpose(1, 2)

    def _stage(self, stage, x, mask, time_projection, convs, blocks):
        """Resnet then transformer blocks, time-major (2B, N, C_in) -> (2B, N, C); `time_projection` is the
        resnet's `mlp` of the time embedding (`_FusedWeights.time_projections`)."""
        resnet: CausalResnetBlock1D = stage[0]
        masked = x * mask  # read by block1 and the residual conv
        h = self._block(resnet.block1, masked, mask, convs) + time_projection.unsqueeze(1)
        h = self._block(resnet.block2, h * mask, mask, convs)
        h = h + _pointwise(resnet.res_conv, masked)
        for block in stage[1]:
            h = blocks.run(block, h)
        return h

    @staticmethod
    def _block(block: CausalBlock1D, masked, mask, convs) -> torch.Tensor:
        """Causal conv, LayerNorm, Mish over an input the caller has masked; the output is masked too."""
        conv, _, norm, _, mish = block.block
        return mish(norm(convs.conv(conv, masked))) * mask

    # -- bookkeeping -------------------------------------------------------------------------------------
    @staticmethod
    def commit(own: CachedSegment, update: Optional[CachedSegment]) -> None:
        """Append a call's new caches (from `run_pending`) to a stream's own segment."""
        if update is None:
            return
        enc, est = update.encoder, update.estimator
        e = own.encoder
        e.kv = _cat(e.kv, enc.kv, dim=3)
        e.up_kv = _cat(e.up_kv, enc.up_kv, dim=3)
        e.up_tail = enc.up_tail
        e.tokens += enc.tokens
        s = own.estimator
        # a step's kept frames are views of the whole call's (`_kept`): copied out, so a stream holds only its own
        s.kv = ([_cat(old, new, dim=3) for old, new in zip(s.kv, est.kv)] if s.kv
                else [new.contiguous() for new in est.kv])
        s.tails = [tail.contiguous() for tail in est.tails]
        s.frames += est.frames


@dataclass(frozen=True)
class _FusedWeights:
    """Weights of the estimator joined so that a step launches fewer kernels (~1,300 a step for the released
    model, launch-bound at a few rows): each transformer block's q, k and v projections as one weight (one GEMM
    instead of three, and one copy of the new keys and values instead of two: 168 fewer kernels over its 56
    blocks), and the 14 resnets' projections of the time embedding, which all read the same Mish(temb), as one
    (26 fewer). Copies: the flow's weights must not change after the runner is made."""

    qkv: list[torch.Tensor]  # per transformer block, in call order (`_BlockKV`)
    time_weight: torch.Tensor  # the resnets' `mlp` linears stacked, in call order
    time_bias: torch.Tensor
    time_sizes: list[int]

    @classmethod
    def of(cls, est: torch.nn.Module) -> "_FusedWeights":
        stages = (*est.down_blocks, *est.mid_blocks, *est.up_blocks)
        qkv = [torch.cat([b.attn1.to_q.weight, b.attn1.to_k.weight, b.attn1.to_v.weight]).detach()
               for stage in stages for b in stage[1]]
        time = [stage[0].mlp[1] for stage in stages]
        return cls(qkv, torch.cat([m.weight for m in time]).detach(), torch.cat([m.bias for m in time]).detach(),
                   [m.out_features for m in time])

    def time_projections(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every resnet's `mlp(temb)` (Mish, then its linear), in call order, from one GEMM."""
        return F.linear(F.mish(temb), self.time_weight, self.time_bias).split(self.time_sizes, dim=-1)


def _pointwise(conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A kernel-1 conv over time-major x (B, N, C_in) -> (B, N, C_out): a linear layer on the same weights."""
    return F.linear(x, conv.weight.squeeze(-1), conv.bias)


class _ConvTails:
    """Causal convs with the previous call's last inputs as left context, in call order; collects the new tails.

    All convs' tails travel as one tensor (2B, sum of input channels, 2), each conv reading its channel slice.
    Inputs are time-major (2B, N, C): a kernel-3 conv is then one GEMM of the weight, viewed (C_out, 3 C), over
    each frame's window of three frames (its 2 predecessors and itself) laid side by side."""

    def __init__(self, tails: Optional[torch.Tensor], tail_at: torch.Tensor) -> None:
        self.tails, self.tail_at = tails, tail_at  # tail_at (2B, 1, 2): positions in [context | new] to keep
        self.offset = 0
        self.out: list[torch.Tensor] = []

    def conv(self, conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """x (2B, N, C) masked input -> conv output (2B, N, C')."""
        context, channels = conv.kernel_size[0] - 1, x.size(2)
        assert context == CONV_CONTEXT
        if self.tails is None:
            left = x.new_zeros(x.size(0), context, channels)
        else:
            left = self.tails[:, self.offset : self.offset + channels].transpose(1, 2)
        self.offset += channels
        seq = torch.cat([left, x], dim=1)  # (2B, 2 + N, C)
        at = self.tail_at.view(-1, CONV_CONTEXT, 1).expand(-1, -1, channels)
        self.out.append(seq.gather(1, at).transpose(1, 2))
        # (2B, N, C, 3) windows -> (2B, N, 3C) in the weight's (channel, tap) order
        windows = seq.unfold(1, context + 1, 1).reshape(x.size(0), x.size(1), channels * (context + 1))
        return F.linear(windows, conv.weight.reshape(conv.out_channels, -1), conv.bias)

    def collected(self) -> torch.Tensor:
        return torch.cat(self.out, dim=1)


class _BlockKV:
    """Transformer blocks over new frames attending to history + new keys/values held in one buffer, in call order.

    The buffer (blocks, 2, 2B, hist_p + N, heads, d) has the history in its first hist_p frames; each block writes
    its new keys/values after them and attends to the whole buffer (the bias masks padding). Frames before heads: a
    projection's output (2B, N, heads x d) lands there as one contiguous run per row, and attention reads the
    (2B, heads, frames, d) transposed view, as it reads the queries."""

    def __init__(self, keys: torch.Tensor, hist_p: int, qkv_weights: Sequence[torch.Tensor],
                 bias: torch.Tensor) -> None:
        self.keys, self.hist_p, self.qkv_weights, self.bias = keys, hist_p, qkv_weights, bias
        self.index = 0

    def run(self, block: TransformerBlock, x: torch.Tensor) -> torch.Tensor:
        attn = block.attn1
        batch, length, _ = x.shape
        h = block.norm1(x)
        # q | k | v of every frame in one GEMM; the new keys and values go after the history in one copy
        qkv = F.linear(h, self.qkv_weights[self.index]).view(batch, length, 3, attn.heads, attn.head_dim)
        kv = self.keys[self.index]  # (2, 2B, hist_p + N, heads, d)
        copy_runs(kv[:, :, self.hist_p :], qkv[:, :, 1:].permute(2, 0, 1, 3, 4))
        self.index += 1
        q, k, v = qkv[:, :, 0].transpose(1, 2), kv[0], kv[1]
        out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.bias)
        x = x + attn.to_out[0](out.transpose(1, 2).reshape(batch, length, attn.heads * attn.head_dim))
        return x + block.ff(block.norm3(x))

    def collected(self) -> torch.Tensor:
        return self.keys[:, :, :, self.hist_p :]  # (blocks, 2, 2B, N, heads, d): a view of the buffer


_StepStatics = tuple[torch.Tensor, ...]  # x, mask, mu, t, spks, cond, bias, tail_at
_StepOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # velocity, k/v, conv tails


class StepGraphs(GridGraphs[_StepStatics, _StepOutputs, tuple[torch.Tensor, torch.Tensor]]):
    """CUDA graphs of one cached estimator evaluation, per (rows, new frames, history frames) bucket.

    Uncached, the Euler loop is launch-bound (about a thousand small kernels per estimator call); cached, it
    also attends to a history that differs per row. A call is padded to a bucket (`STEP_ROWS`, `STEP_NEW_FRAMES`,
    `STEP_HISTORY_FRAMES`: each dimension up to the next size); padding is masked (zero mask, -1e10 attention bias), so the
    real rows and frames are exact. The history of the call's rows is copied before each step into one static
    buffer that every graph views (sized for the largest bucket, allocated on first use; with it the conv tails);
    a graph's outputs live in the shared pool and are valid until the next replay: callers copy what they keep at
    once. One thread at a time (a lock guards fill + replay).
    """

    def __init__(self, runner: CachedFlowRunner, rows: Sequence[int] = STEP_ROWS,
                 new_frames: Sequence[int] = STEP_NEW_FRAMES, history_frames: Sequence[int] = STEP_HISTORY_FRAMES):
        super().__init__()
        self.runner = runner
        self.rows, self.new_frames, self.history_frames = tuple(rows), tuple(new_frames), tuple(history_frames)

    def sizes(self) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
        return self.rows, self.new_frames, self.history_frames

    def run(self, shape: tuple[int, int, int], rows: Sequence[CachedRow], steps: Sequence[int], x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
            cond: torch.Tensor, bias: torch.Tensor, tail_at: torch.Tensor):
        rows_p, _, hist_p = shape
        with self._lock:
            captured = self._get(shape, x.device, x.dtype)
            keys, tails = self._views(shape)
            self.runner._gather_history(rows, steps, hist_p, rows_p, out=keys[:, :, :, :hist_p])
            self.runner._gather_tails(rows, steps, rows_p, out=tails)
            for static, value in zip(captured.inputs, (x, mask, mu, t, spks, cond, bias, tail_at)):
                static.copy_(value)
            if captured.graph is None:  # emulation on CPU
                return self.runner.estimate(*captured.inputs[:7], keys, hist_p, tails, captured.inputs[7])
            captured.graph.replay()
            return captured.outputs

    # -- capture ---------------------------------------------------------------------------------------
    def _views(self, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's views of the history buffer (keys and values) and of the conv tails."""
        rows_p, new, hist_p = shape
        assert self._buffers is not None
        history, tails = self._buffers
        return history[:, :, : 2 * rows_p, : hist_p + new], tails[: 2 * rows_p]

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The static history and tail buffers."""
        est = self.runner.flow.decoder.estimator
        cfg = est.config
        blocks = sum(len(stage[1]) for stage in (*est.down_blocks, *est.mid_blocks, *est.up_blocks))
        rows, history = 2 * max(self.rows), max(self.history_frames) + max(self.new_frames)
        return (torch.zeros(blocks, 2, rows, history, cfg.num_heads, cfg.attention_head_dim,
                            device=device, dtype=dtype),
                torch.zeros(rows, self._tail_channels(), CONV_CONTEXT, device=device, dtype=dtype))

    def _tail_channels(self) -> int:
        """Input channels of every causal conv of the estimator (their tails travel as one tensor)."""
        est = self.runner.flow.decoder.estimator
        total = est.final_block.block[0].in_channels
        for stage in (*est.down_blocks, *est.mid_blocks, *est.up_blocks):
            total += stage[0].block1.block[0].in_channels + stage[0].block2.block[0].in_channels
            total += stage[2].in_channels if len(stage) > 2 else 0
        return total

    def _inputs(self, shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> _StepStatics:
        rows_p, new, hist_p = shape
        mel = self.runner.flow.decoder.estimator.config.out_channels
        return (
            torch.zeros(2 * rows_p, mel, new, device=device, dtype=dtype),  # x
            torch.zeros(2 * rows_p, 1, new, device=device, dtype=dtype),  # mask
            torch.zeros(2 * rows_p, mel, new, device=device, dtype=dtype),  # mu
            torch.zeros(2 * rows_p, device=device, dtype=dtype),  # t
            torch.zeros(2 * rows_p, mel, device=device, dtype=dtype),  # spks
            torch.zeros(2 * rows_p, mel, new, device=device, dtype=dtype),  # cond
            torch.zeros(2 * rows_p, 1, new, hist_p + new, device=device, dtype=dtype),  # bias
            torch.zeros(2 * rows_p, 1, CONV_CONTEXT, device=device, dtype=torch.long),  # tail_at
        )

    def _pass(self, shape: tuple[int, int, int], inputs: _StepStatics) -> Callable[[], _StepOutputs]:
        keys, tails = self._views(shape)
        return lambda: self.runner.estimate(*inputs[:7], keys, shape[2], tails, inputs[7])
