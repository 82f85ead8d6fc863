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

Rows of different histories and lengths run in one call, packed on one frame axis, each row attending to its own
history (`packed`); they run their Euler steps in lock step (one estimator evaluation of every row per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from speech_lm.graph_buckets import fitting_first
from .cached_encoder import CachedEncoder, EncoderCache
from .estimator import CausalBlock1D, CausalResnetBlock1D

CONV_CONTEXT = 2  # every causal conv of the estimator has kernel 3

def encoder_rows(largest: int) -> tuple[int, ...]:
    """The encoder's CUDA-graph buckets of rows for calls of up to `largest` rows (the packed solve's cap): every
    count up to 4, then steps of a half between the powers of two (6, 8, 12, 16, 24, 32, ...), so a call of 5, 9 or
    10 rows does not pay for 8 or 16, and `largest` itself."""
    if largest < 1:
        raise ValueError(f"a call takes at least one row, got {largest}")
    steps, size = [1, 2, 3, 4], 4
    while size < largest:
        steps += [size * 3 // 2, size * 2]
        size *= 2
    return tuple(r for r in steps if r < largest) + (largest,)



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
    """A cached row of a call at the start of its Euler solve (`CachedFlowRunner._begin`): its encoder output, the
    ODE's start state and where its frames lie."""

    row: CachedRow
    mu: torch.Tensor  # (80, new) encoder output of the new frames
    x: torch.Tensor  # (80, new) the ODE's start noise
    cond: torch.Tensor  # (80, new) prompt mel frames inside the call, zeros elsewhere
    spks: torch.Tensor  # (80,)
    start: int  # first new frame (absolute) = history frames
    new: int  # new frames
    kept: int  # frames whose estimator states are cached afterwards


def _cat(a: Optional[torch.Tensor], b: torch.Tensor, dim: int) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=dim)


# ---- the cached forward ----------------------------------------------------------------------------------
class CachedFlowRunner:
    """Runs `CausalFlow` over new frames with caches. Stateless apart from the flow; any number of streams."""

    def __init__(self, flow: torch.nn.Module, graphs: bool = True, max_rows: Optional[int] = None) -> None:
        """`max_rows`: rows per call the CUDA graphs take at most (default `packed.PACKED_ROWS`); a call of more runs
        eagerly, so a server caps its calls there (`max_rows`)."""
        from .packed import PACKED_ROWS, PackedFlow  # it builds on this module

        rows = PACKED_ROWS if max_rows is None else max_rows
        self.flow = flow
        # new frames of every call the estimator ran: needed, and computed (the packed frame axis padded up to its
        # CUDA-graph bucket); their ratio is the padding's share of the estimator's work
        self.frames_needed = 0
        self.frames_computed = 0
        # the encoder pass (once per call), from CUDA graphs of its own buckets (`cached_encoder.EncoderGraphs`)
        self.encoder = CachedEncoder(flow, graphs, row_buckets=encoder_rows(rows))
        self.config = flow.config
        self.fused = _FusedWeights.of(flow.decoder.estimator)
        # the Euler solve over the call's rows packed on one frame axis, from CUDA graphs where the call fits
        self.solver = PackedFlow(self, graphs, rows)
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
        """The CUDA graphs of the Euler solve (`packed.PackedGraphs`), or None."""
        return self.solver.graphs

    @property
    def max_rows(self) -> Optional[int]:
        """Rows per call that the solve's graphs take at most (None without graphs)."""
        return self.solver.graphs.row_count if self.solver.graphs is not None else None

    def fits_graphs(self, row: CachedRow) -> bool:
        """Whether a call of this row alone fits a bucket of the estimator's graphs and (where it has any) of the
        encoder's."""
        new, history = (row.stop - row.start) * self.stride, row.start * self.stride
        if not self.solver.fits_graphs(new, history):
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
        """All Euler steps of a batch of rows (one whole call), packed (`packed.PackedFlow.solve`)."""
        return self.solver.solve(rows, mu)

    def _begin(self, rows: Sequence[CachedRow], mu: torch.Tensor) -> list["SolvingRow"]:
        """Each row's start of the solve: its encoder output, its noise (indexed by absolute frame) and cond."""
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

    def network(self, x, mask, mu, t, spks, cond, convs, blocks) -> torch.Tensor:
        """The estimator's layers over time-major activations -> velocity (rows, 80, frames): x, mu, spks, cond
        (rows, 80, frames), mask (rows, 1, frames), t (rows,). What makes it a cached evaluation is passed in:
        `convs` (`conv(module, x)`: causal convs with their left context) and `blocks` (`run(block, x)`:
        transformer blocks attending to their history), over rows packed on one frame axis (`packed`).

        The activations stay time-major, (rows, frames, channels), from the first layer to the last, unlike the
        module's own forward (channels first around every conv, time-major in the transformer blocks): flipping
        between the two made every LayerNorm, Mish, mask and conv input a strided copy, about a fifth of a step's
        GPU time; time-major, a causal conv is one GEMM over each frame's window of three frames."""
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
        # a step's kept frames are views of the whole call's (`PackedFlow.solve`): copied out, so a stream holds
        # only its own
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

    qkv: list[torch.Tensor]  # per transformer block, in call order (`packed._PackedBlocks`)
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


