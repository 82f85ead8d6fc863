"""Packed rows: a cached flow call's rows on one frame axis, each attending to its own history only.

Why packed: padded to the call's longest row (new frames), to the longest history and to a rows bucket, 43-50 % of
the estimator's frame-rows and 62-65 % of its attention were padding on an H200 at 16 and more streams (first
chunks of ~50-104 frames ride with later chunks of 200, and a fresh stream attends over a long stream's history
length); packed, the served stack answered faster at every level (docs/experiments/2026-11-28-packed-rows.md).

Here the rows' new frames lie one after another on a single frame axis (the guidance rows, conditional and
unconditional, stay a batch of two). Everything the estimator does per frame (linear layers, LayerNorm, Mish,
masks) runs over that axis as it is; the two things that look across frames take the row boundaries from a
`PackedLayout` built once per call:
- causal convs read each frame's window of three (its two predecessors and itself) through an index into
  [every row's two tail frames | the packed frames], so no window crosses into another row;
- attention is per row: a row's keys are [its history | its new frames], laid one row after another in one key
  buffer, and its queries run in pieces of one attention chunk (50 frames), each seeing the keys up to the end of
  its chunk (every key of the row for a final row). On a GPU that is one variable-length flash attention call: a
  piece is a sequence whose keys start where its row's do and whose length (`seqused_k`) ends at its chunk, so the
  pieces of one row share their keys in place. Elsewhere the same visibility is an explicit mask.

The rows advance in lock step over the Euler steps, and the packed layout holds for the whole call: the ODE state
stays packed from the first step to the last.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from speech_lm.graph_buckets import GridGraphs
from speech_lm.kernels import copy_runs, gather_rows, scatter_rows

from .cached import CONV_CONTEXT, CachedFlowRunner, CachedRow, EstimatorCache

#: A trash key slot after every row's keys: where the padding frames' keys go and what padding queries attend to.
_TRASH = 1


def keys_needed(news: Sequence[int], hists: Sequence[int]) -> int:
    """Key slots of a packed call: every row's history and new frames, and the trash slot."""
    return sum(hists) + sum(news) + _TRASH


def half_precision(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PackedLayout:
    """Where each row of a call lies on the packed axes, and the index tensors the estimator reads them by.

    Frames: row r's new frames are frames [frame_at[r], frame_at[r] + news[r]) of `frames` (the rest, at the end,
    padding). Keys: row r's history then new frames are keys [key_at[r], key_at[r] + hists[r] + news[r]) of `keys`
    (the last key is the trash slot). Attention pieces are listed per guidance row (conditional then
    unconditional), each guidance row's queries and keys a half of the folded (2 x frames) and (2 x keys) axes."""

    news: tuple[int, ...]
    hists: tuple[int, ...]
    finals: tuple[bool, ...]
    kept: tuple[int, ...]
    frames: int
    keys: int
    frame_at: tuple[int, ...]
    key_at: tuple[int, ...]
    window: torch.Tensor  # (3 frames,) positions in [tails (2 rows) | frames] of each frame's conv window
    tail_at: torch.Tensor  # (2 rows,) positions in [tails | frames] of each row's new tails (its last kept frames)
    new_key_at: torch.Tensor  # (frames,) key slot of each frame's new key (padding: the trash slot)
    cu_queries: torch.Tensor  # (pieces + 1,) int32: query offsets of the pieces on the folded query axis
    piece_keys: torch.Tensor  # (pieces + 1,) int32: where each piece's keys start on the folded key axis
    piece_used: torch.Tensor  # (pieces,) int32: how many keys each piece sees
    longest_piece: int
    longest_keys: int

    @property
    def rows(self) -> int:
        return len(self.news)

    @classmethod
    def of(cls, news: Sequence[int], hists: Sequence[int], finals: Sequence[bool], kept: Sequence[int], chunk: int,
           device: torch.device, frames: Optional[int] = None, keys: Optional[int] = None,
           rows: Optional[int] = None, pieces: Optional[int] = None) -> "PackedLayout":
        """The layout of rows with `news` new frames after `hists` history frames (multiples of `chunk`).
        `frames`, `keys` and `rows` size the axes and index tensors for a CUDA graph (at least what the rows need):
        padding frames at the end, unused key slots, rows without frames (their tails unread) and pieces without
        queries (`pieces_for`)."""
        count = len(news)
        if any(h % chunk for h in hists):
            raise ValueError(f"packed rows start on the {chunk}-frame grid, not at {list(hists)}")
        need_frames, need_keys = sum(news), keys_needed(news, hists)
        frames = need_frames if frames is None else frames
        keys = need_keys if keys is None else keys
        rows = count if rows is None else rows
        if frames < need_frames or keys < need_keys or rows < count:
            raise ValueError(f"packed axes of {frames} frames / {keys} keys / {rows} rows hold fewer than the "
                             f"rows' {need_frames} / {need_keys} / {count}")
        news_a, hists_a = np.asarray(news, dtype=np.int64), np.asarray(hists, dtype=np.int64)
        frame_at = np.concatenate([[0], np.cumsum(news_a)[:-1]]).astype(np.int64)
        key_at = np.concatenate([[0], np.cumsum(news_a + hists_a)[:-1]]).astype(np.int64)
        trash = keys - 1
        tails = CONV_CONTEXT * rows  # every row's tail frames come first in a conv's input sequence

        def position(row: np.ndarray, j: np.ndarray) -> np.ndarray:
            """Where frame j (< 0: a tail frame) of `row` lies in [tails | frames]."""
            return np.where(j >= 0, tails + frame_at[row] + j, CONV_CONTEXT * row + CONV_CONTEXT + j)

        row = np.repeat(np.arange(count), news_a)
        local = np.arange(need_frames) - frame_at[row]
        window = np.stack([position(row, local - back) for back in range(CONV_CONTEXT, -1, -1)], axis=1)
        padding = tails + np.arange(need_frames, frames)
        window = np.concatenate([window, np.repeat(padding[:, None], CONV_CONTEXT + 1, axis=1)])
        new_key = np.concatenate([key_at[row] + hists_a[row] + local, np.full(frames - need_frames, trash)])
        # each row's new tails: its inputs at kept-2, kept-1 (nothing kept: its old tails again); rows beyond the
        # call's read its first tail slot (never used)
        kept_a = np.asarray(kept, dtype=np.int64)
        tail_at = np.stack([position(np.arange(count), kept_a - back) for back in range(CONV_CONTEXT, 0, -1)], 1)
        tail_at = np.concatenate([tail_at.reshape(-1), np.zeros(CONV_CONTEXT * (rows - count), dtype=np.int64)])
        # attention pieces, guidance row by guidance row; padding queries in pieces of at most `chunk` that see the
        # trash key
        cu, starts, used = [0], [], []
        for g in range(2):
            q0, k0 = g * frames, g * keys
            for r, (new, hist, final) in enumerate(zip(news, hists, finals)):
                for c1 in range(min(new, chunk), new + chunk, chunk):
                    c1 = min(new, c1)
                    cu.append(q0 + int(frame_at[r]) + c1)
                    starts.append(k0 + int(key_at[r]))
                    used.append(hist + (new if final else c1))
                    if c1 == new:
                        break
            for end in range(need_frames + chunk, frames + chunk, chunk):
                cu.append(q0 + min(end, frames))
                starts.append(k0 + trash)
                used.append(_TRASH)
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if pieces is not None:  # pieces without queries fill the capacity
            if pieces < len(used):
                raise ValueError(f"{len(used)} attention pieces, capacity {pieces}")
            spare = pieces - len(used)
            cu, starts, used = cu + [cu[-1]] * spare, starts + [2 * keys - 1] * spare, used + [0] * spare
        starts.append(2 * keys)  # the end of the key axis (flash attention reads starts[s] only, with `used`)

        def tensor(values, dtype=torch.long) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values), dtype=dtype).to(device)

        return cls(tuple(news), tuple(hists), tuple(finals), tuple(kept), frames, keys,
                   tuple(int(v) for v in frame_at), tuple(int(v) for v in key_at), tensor(window.reshape(-1)),
                   tensor(tail_at), tensor(new_key), tensor(cu, torch.int32), tensor(starts, torch.int32),
                   tensor(used, torch.int32), longest, max(used))

    @staticmethod
    def pieces_for(frames: int, rows: int, chunk: int) -> int:
        """Attention pieces of any call of at most `rows` rows on `frames` packed frames: per guidance row each row's
        pieces (its new frames / chunk, rounded up) and the padding's, at most frames / chunk + rows + 1."""
        return 2 * (frames // chunk + rows + 2)

    def index(self) -> "PackedIndex":
        return PackedIndex(self.window, self.tail_at, self.new_key_at, self.cu_queries, self.piece_keys,
                           self.piece_used, self.longest_piece, self.longest_keys, self.keys)

    def visible(self) -> torch.Tensor:
        """(2 frames, 2 keys) bool: which keys each query of the folded axes sees (the pieces as a dense mask)."""
        device = self.cu_queries.device
        cu, starts, used = self.cu_queries.long(), self.piece_keys[:-1].long(), self.piece_used.long()
        piece = torch.repeat_interleave(torch.arange(used.numel(), device=device), cu[1:] - cu[:-1])
        lo, hi = starts[piece], starts[piece] + used[piece]
        slot = torch.arange(2 * self.keys, device=device)
        return (slot >= lo.unsqueeze(1)) & (slot < hi.unsqueeze(1))


@dataclass(frozen=True)
class PackedIndex:
    """What the estimator's layers read of a layout: the index tensors (a call's own, or a CUDA graph's static
    copies of them) and the sizes an attention call is launched with."""

    window: torch.Tensor
    tail_at: torch.Tensor
    new_key_at: torch.Tensor
    cu_queries: torch.Tensor
    piece_keys: torch.Tensor
    piece_used: torch.Tensor
    longest_piece: int
    longest_keys: int
    keys: int


def flash_pieces(q: torch.Tensor) -> bool:
    """Whether `piece_attention` runs as one flash attention call for these queries (a GPU, half precision)."""
    return q.is_cuda and half_precision(q.dtype)


def piece_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: PackedIndex,
                    visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of the packed queries (2 frames, heads, d) over the packed keys/values (2 keys, heads, d), piece
    by piece (`PackedLayout`). On a GPU in half precision one variable-length flash attention call (static shapes,
    no host sync: CUDA-graph safe); otherwise through `visible` (`PackedLayout.visible`)."""
    if flash_pieces(q):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, index.cu_queries, index.piece_keys, index.longest_piece, index.longest_keys, 0.0, False, False,
            seqused_k=index.piece_used)[0]
    if visible is None:
        raise ValueError("attention pieces off a GPU need the layout's visibility mask")
    mask = visible
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask)
    return out[0].transpose(0, 1)


class _PackedConvs:
    """Causal convs over packed frames (2, frames, C) with every row's two tail frames as its left context; the
    tails of all convs travel as one tensor (2, 2 rows, channels of all convs), each conv reading its slice."""

    def __init__(self, tails: torch.Tensor, index: PackedIndex, weights: dict[int, torch.Tensor]) -> None:
        self.tails, self.index, self.weights = tails, index, weights
        self.offset = 0
        self.out: list[torch.Tensor] = []

    def conv(self, conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        channels = x.size(2)
        left = self.tails[:, :, self.offset : self.offset + channels]
        self.offset += channels
        seq = torch.cat([left, x], dim=1)  # (2, 2 rows + frames, C)
        self.out.append(gather_rows(seq, self.index.tail_at))
        windows = gather_rows(seq, self.index.window).view(x.size(0), x.size(1), (CONV_CONTEXT + 1) * channels)
        return F.linear(windows, self.weights[id(conv)], conv.bias)

    def collected(self) -> torch.Tensor:
        return torch.cat(self.out, dim=2)  # (2, 2 rows, channels of all convs)


class _PackedBlocks:
    """Transformer blocks over packed frames: each writes its new keys/values into its rows' key slots and attends
    piece by piece (`piece_attention`). `keys` (blocks, 2 k/v, 2 guidance, key slots, heads, d)."""

    def __init__(self, keys: torch.Tensor, index: PackedIndex, qkv_weights: Sequence[torch.Tensor],
                 visible: Optional[torch.Tensor]) -> None:
        self.keys, self.index, self.qkv_weights, self.visible = keys, index, qkv_weights, visible
        self.block = 0

    def run(self, block, x: torch.Tensor) -> torch.Tensor:
        attn = block.attn1
        guidance, frames, _ = x.shape
        qkv = F.linear(block.norm1(x), self.qkv_weights[self.block]).view(guidance, frames, 3, attn.heads,
                                                                          attn.head_dim)
        kv = self.keys[self.block]  # (2 k/v, 2 guidance, key slots, heads, d)
        for j in (0, 1):  # the keys, then the values: each frame's row of heads x d into its key slot
            scatter_rows(kv[j].flatten(2), self.index.new_key_at, qkv[:, :, 1 + j].flatten(2))
        self.block += 1
        flat = (guidance * self.index.keys, attn.heads, attn.head_dim)
        out = piece_attention(qkv[:, :, 0].reshape(guidance * frames, attn.heads, attn.head_dim),
                              kv[0].view(flat), kv[1].view(flat), self.index, self.visible)
        x = x + attn.to_out[0](out.reshape(guidance, frames, attn.heads * attn.head_dim))
        return x + block.ff(block.norm3(x))


#: The CUDA-graph buckets of packed calls: one graph per size of the packed frame axis (a call's new frames
#: together, padded up to the next size), each for up to `PACKED_ROWS` rows. The key axis is the same for every graph
#: (`packed_keys`): attention reads each piece's own keys (`seqused_k`), so its size costs memory, not time. Every
#: 128 frames up to 2048 and every 256 up to 4096 the streaming calls (16 rows of at most 256 new frames): the
#: padding is computed at each of the 10 Euler steps, and with steps of 256 from 512 on (14 buckets) it was 15-22 %
#: of the estimator's frames from 16 streams on (H200); 6144 and 8192 take offline calls (whole utterances of a few
#: hundred frames each). The graphs share one memory pool (captured largest first), so more of them cost capture
#: time at start (~0.85 s each), not activation memory.
#: The frames of the largest streaming call of 16 rows (16 x `LONGEST_NEW`), where the 256-frame steps end.
_STREAMING_FRAMES_16 = 4096
PACKED_FRAMES = (*range(128, 2048 + 1, 128), *range(2304, _STREAMING_FRAMES_16 + 1, 256), 6144, 8192)
#: Rows per call: a burst of up to 32 new streams' first chunks shares one call instead of the last ones waiting a
#: whole call behind the first 16 (one H100, c=32 first chunk p90 419-423 ms against 476-515 at 16; docs/experiments/
#: 2026-12-07-h100-token2wav-rows.md), for 504 MiB of key axis per row.
PACKED_ROWS = 32


#: Key slots per row of the packed graphs' key axis: the longest history a stream's calls replay from graphs at a
#: full call (2048 frames, 41 s of audio; the encoder's graphs stop there too) and a call's longest new frames (256,
#: the encoder's 128 tokens). The axis is shared by the call's rows, so a longer history fits beside short ones; a
#: call beyond it runs eagerly.
LONGEST_HISTORY, LONGEST_NEW = 2048, 256
PACKED_KEYS_PER_ROW = LONGEST_HISTORY + LONGEST_NEW


def transformer_blocks(estimator: torch.nn.Module) -> int:
    """The estimator's transformer blocks, each with a slice of the packed graphs' key buffer."""
    return sum(len(stage[1]) for stage in (*estimator.down_blocks, *estimator.mid_blocks, *estimator.up_blocks))


def key_buffer_shape(estimator: torch.nn.Module, keys: int) -> tuple[int, ...]:
    """The packed graphs' key buffer of `keys` slots: (blocks, keys and values, both guidance rows, slots, heads,
    head_dim)."""
    cfg = estimator.config
    return (transformer_blocks(estimator), 2, 2, keys, cfg.num_heads, cfg.attention_head_dim)


def key_bytes_per_row(estimator: torch.nn.Module, dtype: torch.dtype) -> int:
    """The packed graphs' key buffer per row of `PackedGraphs`: 504 MiB at the released size in bf16."""
    return math.prod(key_buffer_shape(estimator, PACKED_KEYS_PER_ROW)) * dtype.itemsize


def packed_keys(rows: int = PACKED_ROWS) -> int:
    """The key axis of the packed graphs."""
    return rows * PACKED_KEYS_PER_ROW + _TRASH


def packed_frames(rows: int = PACKED_ROWS) -> tuple[int, ...]:
    """The packed-frames buckets of graphs for calls of up to `rows` rows: `PACKED_FRAMES`, and with more than 16
    rows every 512 frames from 4096 up to what their streaming calls reach (rows x `LONGEST_NEW`), so a burst of
    first chunks in one large call is not padded by up to half to 6144 or 8192."""
    wider = range(_STREAMING_FRAMES_16 + 512, rows * LONGEST_NEW + 1, 512)  # empty up to 16 rows
    return tuple(sorted({*PACKED_FRAMES, *wider}))


_PackedStatics = tuple[torch.Tensor, ...]  # x, mask, mu, t, spks, cond, then the index tensors of `PackedIndex`


class PackedGraphs(GridGraphs[_PackedStatics, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
    """CUDA graphs of one packed estimator evaluation per (rows, frames, keys) bucket: rows and keys have one size
    each, frames `PACKED_FRAMES`. The keys/values of every block and the conv tails live in two static buffers that
    every graph reads (filled before each step: the rows' histories, their last conv inputs); a graph's outputs
    (velocity, new conv tails) are valid until the next replay."""

    def __init__(self, packed: "PackedFlow", frames: Optional[Sequence[int]] = None, rows: int = PACKED_ROWS) -> None:
        """`frames`: the packed-frames buckets (default `packed_frames(rows)`)."""
        super().__init__()
        self.packed = packed
        self.frame_sizes = tuple(packed_frames(rows) if frames is None else frames)
        self.row_count, self.key_count = rows, packed_keys(rows)

    def sizes(self) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
        return (self.row_count,), self.frame_sizes, (self.key_count,)

    @property
    def lock(self):
        return self._lock

    def capture_all(self, device: torch.device, dtype: torch.dtype) -> int:
        """Every bucket captured now; none where attention is not one flash call (no GPU, full precision): such
        calls run eagerly."""
        if torch.device(device).type != "cuda" or not half_precision(dtype):
            return 0
        return super().capture_all(device, dtype)

    def statics(self, shape, device: torch.device, dtype: torch.dtype):
        """The bucket's captured entry (captured now if new, on a GPU) and the static key and tail buffers."""
        captured = self._get(shape, device, dtype)
        assert self._buffers is not None
        return captured, self._buffers

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        estimator = self.packed.runner.flow.decoder.estimator
        return (torch.zeros(key_buffer_shape(estimator, self.key_count), device=device, dtype=dtype),
                torch.zeros(2, CONV_CONTEXT * self.row_count, self.packed.tail_channels, device=device, dtype=dtype))

    def _inputs(self, shape, device: torch.device, dtype: torch.dtype) -> _PackedStatics:
        rows, frames, _ = shape
        mel = self.packed.runner.flow.decoder.estimator.config.out_channels
        pieces = PackedLayout.pieces_for(frames, rows, self.packed.chunk)

        def zeros(*size, kind=dtype):
            return torch.zeros(*size, device=device, dtype=kind)

        return (zeros(2, mel, frames), zeros(2, 1, frames), zeros(2, mel, frames), zeros(2), zeros(2, mel, frames),
                zeros(2, mel, frames), zeros((CONV_CONTEXT + 1) * frames, kind=torch.long),
                zeros(CONV_CONTEXT * rows, kind=torch.long), zeros(frames, kind=torch.long),
                zeros(pieces + 1, kind=torch.int32), zeros(pieces + 1, kind=torch.int32),
                zeros(pieces, kind=torch.int32))

    def index_of(self, inputs: _PackedStatics) -> PackedIndex:
        window, tail_at, new_key_at, cu, starts, used = inputs[6:]
        return PackedIndex(window, tail_at, new_key_at, cu, starts, used, self.packed.chunk, self.key_count,
                           self.key_count)

    def _pass(self, shape, inputs: _PackedStatics):
        assert self._buffers is not None
        keys, tails = self._buffers
        return lambda: self.packed.evaluate(inputs[:6], keys, tails, self.index_of(inputs), None)


class PackedFlow:
    """`CachedFlowRunner`'s Euler solve with the call's rows packed (`solve`), from
    CUDA graphs (`PackedGraphs`) where the call fits one and runs on a GPU."""

    def __init__(self, runner: CachedFlowRunner, graphs: bool = True, rows: int = PACKED_ROWS) -> None:
        self.runner = runner
        est = runner.flow.decoder.estimator
        # causal conv weights as (out, 3 x in) with the tap major: the gathered windows' (tap, channel) order
        self.conv_weights = {id(m): m.weight.detach().permute(0, 2, 1).reshape(m.out_channels, -1)
                             for m in est.modules() if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] == 3}
        self.chunk = est.config.static_chunk_size
        self.tail_channels = sum(m.in_channels for m in est.modules()
                                 if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] == 3)
        self.graphs: Optional[PackedGraphs] = PackedGraphs(self, rows=rows) if graphs else None

    def bucket(self, news: Sequence[int], hists: Sequence[int], like: torch.Tensor):
        """The graph bucket of a call, or None (eager): off a GPU, or beyond the buckets."""
        if self.graphs is None or not (flash_pieces(like) or self.graphs.emulate):
            return None
        return self.graphs.bucket(len(news), sum(news), keys_needed(news, hists))

    def fits_graphs(self, new: int, history: int) -> bool:
        """Whether a call of one row of `new` frames after `history` fits a packed graph bucket."""
        return self.graphs is not None and self.graphs.bucket(1, new, keys_needed([new], [history])) is not None

    def evaluate(self, statics: Sequence[torch.Tensor], keys: torch.Tensor, tails: torch.Tensor, index: PackedIndex,
                 visible: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One estimator evaluation over packed frames: statics (x, mask, mu, t, spks, cond) -> (velocity (2, 80,
        frames), the new conv tails (2, 2 rows, channels)); the new keys/values land in `keys`' slots."""
        x, mask, mu, t, spks, cond = statics
        convs = _PackedConvs(tails, index, self.conv_weights)
        blocks = _PackedBlocks(keys, index, self.runner.fused.qkv, visible)
        velocity = self.runner.network(x, mask, mu, t, spks, cond, convs, blocks)
        return velocity, convs.collected()

    @torch.inference_mode()
    def solve(self, rows: Sequence[CachedRow], mu: torch.Tensor) -> tuple[list[torch.Tensor], list[EstimatorCache]]:
        """Every Euler step of `rows` (encoder output `mu` (rows, 80, frames), as `CachedFlowRunner._encode` gives
        it): each row's mel (80, frames) float32 of tokens[first_emitted:stop] and its new estimator caches."""
        runner, cfm = self.runner, self.runner.flow.decoder
        solving = runner._begin(rows, mu)
        news, hists = [s.new for s in solving], [s.start for s in solving]
        finals, kept = [r.final for r in rows], [s.kept for s in solving]
        like = solving[0].x
        shape = self.bucket(news, hists, like)
        if shape is None:
            layout = PackedLayout.of(news, hists, finals, kept, self.chunk, like.device)
        else:
            count, frames, keys = shape
            layout = PackedLayout.of(news, hists, finals, kept, self.chunk, like.device, frames=frames, keys=keys,
                                     rows=count, pieces=PackedLayout.pieces_for(frames, count, self.chunk))
        self._count(layout)
        x = self._pack([s.x for s in solving], layout)  # (80, frames): the ODE state, packed for the whole call
        mask = self._pack([torch.ones_like(s.x[:1]) for s in solving], layout)
        zeros = torch.zeros_like(x)
        statics = [torch.stack([x, x]), torch.stack([mask, mask]),
                   torch.stack([self._pack([s.mu for s in solving], layout), zeros]),
                   torch.zeros(2, device=like.device, dtype=like.dtype),
                   torch.stack([self._pack([s.spks.unsqueeze(1).expand(-1, s.new) for s in solving], layout), zeros]),
                   torch.stack([self._pack([s.cond for s in solving], layout), zeros])]
        rate = cfm.config.inference_cfg_rate
        kvs: list[torch.Tensor] = []
        tails_out: list[torch.Tensor] = []
        lock = self.graphs.lock if shape is not None else contextlib.nullcontext()
        with lock:
            if shape is None:
                keys = like.new_zeros(key_buffer_shape(runner.flow.decoder.estimator, layout.keys))
                tails = like.new_zeros(2, CONV_CONTEXT * layout.rows, self.tail_channels)
                index, captured = layout.index(), None
            else:
                captured, (keys, tails) = self.graphs.statics(shape, like.device, like.dtype)
                for static, value in zip(captured.inputs, (*statics, *self._index_tensors(layout))):
                    static.copy_(value)
                statics = list(captured.inputs[:6])
                index = self.graphs.index_of(captured.inputs)
            visible = None if flash_pieces(like) else layout.visible()  # (off a GPU: the pieces as a mask)
            for step, (t, dt) in enumerate(cfm.schedule):
                self._fill_history(keys, rows, step, layout)
                self._fill_tails(tails, rows, step)
                statics[0].copy_(x.expand_as(statics[0]))  # both guidance rows
                statics[3].fill_(t)
                if captured is not None and captured.graph is not None:
                    captured.graph.replay()
                    velocity, new_tails = captured.outputs
                else:
                    velocity, new_tails = self.evaluate(statics, keys, tails, index, visible)
                x = x + dt * ((1.0 + rate) * velocity[0] - rate * velocity[1])
                if any(kept):  # the new keys of every row's frames, in frame order (a row's kept ones lead)
                    new = gather_rows(keys.flatten(0, 2).flatten(2), layout.new_key_at[: sum(news)])
                    kvs.append(new.view(*keys.shape[:3], -1, *keys.shape[4:]))
                    tails_out.append(new_tails.clone())
        mels, caches = [], []
        for r, s in enumerate(solving):
            at = layout.frame_at[r]
            skip = s.row.first_emitted() * runner.stride - s.start
            mels.append(x[:, at + skip : at + s.new].float())
            if not s.kept:
                caches.append(EstimatorCache())
                continue
            caches.append(EstimatorCache(
                s.kept, [kv[:, :, :, at : at + s.kept] for kv in kvs],
                [t[:, 2 * r : 2 * r + CONV_CONTEXT].transpose(1, 2) for t in tails_out]))
        return mels, caches

    def _count(self, layout: PackedLayout) -> None:
        """The runner's padding counters: only the frame axis' padding up to its bucket is computed in vain
        (attention computes each piece's own keys)."""
        self.runner.frames_needed += sum(layout.news)
        self.runner.frames_computed += layout.frames

    @staticmethod
    def _index_tensors(layout: PackedLayout) -> tuple[torch.Tensor, ...]:
        return (layout.window, layout.tail_at, layout.new_key_at, layout.cu_queries, layout.piece_keys,
                layout.piece_used)

    @staticmethod
    def _pack(pieces: Sequence[torch.Tensor], layout: PackedLayout) -> torch.Tensor:
        """Per-row (C, new) tensors -> (C, frames), padding zeroed."""
        out = pieces[0].new_zeros(pieces[0].size(0), layout.frames)
        for piece, at in zip(pieces, layout.frame_at):
            out[:, at : at + piece.size(1)] = piece
        return out

    @staticmethod
    def _fill_history(keys: torch.Tensor, rows: Sequence[CachedRow], step: int, layout: PackedLayout) -> None:
        """Each row's history keys/values at this Euler step into its key slots (prefix, then its own)."""
        for row, at in zip(rows, layout.key_at):
            for segment in (row.prefix, row.own):
                if segment.estimator.frames:
                    piece = segment.estimator.kv[step]  # (blocks, 2, 2, n, heads, d)
                    copy_runs(keys[:, :, :, at : at + piece.size(3)], piece)
                    at += piece.size(3)

    @staticmethod
    def _fill_tails(tails: torch.Tensor, rows: Sequence[CachedRow], step: int) -> None:
        """(2, 2 rows, channels of all convs): each row's last two inputs of every causal conv before its new frames
        (zeros without history)."""
        for r, row in enumerate(rows):
            segment = row.own if row.own.estimator.frames else row.prefix
            at = slice(CONV_CONTEXT * r, CONV_CONTEXT * (r + 1))
            if segment.estimator.frames:  # (2, channels, 2) -> (2, 2, channels)
                tails[:, at] = segment.estimator.tails[step].transpose(1, 2)
            else:
                tails[:, at] = 0
