"""Packed rows: a cached flow call's rows on one frame axis, each attending to its own history only.

`CachedFlowRunner.advance` pads every row of a call to the call's longest row (new frames) and every row's history
to the longest history, and the rows to a CUDA-graph bucket. On an H200 at 16 and more streams 43-50 % of the
estimator's frame-rows and 62-65 % of its attention were that padding: first chunks of ~50-104 frames ride with
later chunks of 200, and a fresh stream attends over a long stream's history length.

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

The rows advance in lock step over the Euler steps, as in the padded path, and the packed layout holds for the
whole call: the ODE state stays packed from the first step to the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .cached import CONV_CONTEXT, CachedFlowRunner, CachedRow, EstimatorCache

#: A trash key slot after every row's keys: where the padding frames' keys go and what padding queries attend to.
_TRASH = 1


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
           device: torch.device, frames: Optional[int] = None, keys: Optional[int] = None) -> "PackedLayout":
        """The layout of rows with `news` new frames after `hists` history frames (multiples of `chunk`);
        `frames`/`keys` pad the axes to a size (a CUDA-graph bucket), at least what the rows need."""
        rows = len(news)
        if any(h % chunk for h in hists):
            raise ValueError(f"packed rows start on the {chunk}-frame grid, not at {list(hists)}")
        need_frames, need_keys = sum(news), sum(hists) + sum(news) + _TRASH
        frames = need_frames if frames is None else frames
        keys = need_keys if keys is None else keys
        if frames < need_frames or keys < need_keys:
            raise ValueError(f"packed axes of {frames} frames / {keys} keys hold fewer than the rows' "
                             f"{need_frames} / {need_keys}")
        frame_at, key_at = [], []
        f = k = 0
        for new, hist in zip(news, hists):
            frame_at.append(f)
            key_at.append(k)
            f += new
            k += hist + new
        trash = keys - 1
        tails = CONV_CONTEXT * rows  # the tail frames come first in every conv's input sequence
        window = []
        new_key = []
        for r, (new, hist) in enumerate(zip(news, hists)):
            for i in range(new):
                for back in range(CONV_CONTEXT, -1, -1):  # frames i-2, i-1, i
                    j = i - back
                    window.append(tails + frame_at[r] + j if j >= 0 else CONV_CONTEXT * r + CONV_CONTEXT + j)
                new_key.append(key_at[r] + hist + i)
        for p in range(need_frames, frames):  # padding frames read themselves and write the trash slot
            window.extend([tails + p] * (CONV_CONTEXT + 1))
            new_key.append(trash)
        # each row's new tails: its inputs at kept-2, kept-1 (with nothing kept, the old tails again)
        tail_at = []
        for r, k in enumerate(kept):
            for back in range(CONV_CONTEXT, 0, -1):
                j = k - back
                tail_at.append(tails + frame_at[r] + j if j >= 0 else CONV_CONTEXT * r + CONV_CONTEXT + j)
        # attention pieces, guidance row by guidance row
        cu, starts, used = [0], [], []
        for g in range(2):
            q0, k0 = g * frames, g * keys
            for r, (new, hist, final) in enumerate(zip(news, hists, finals)):
                for c0 in range(0, new, chunk):
                    c1 = min(new, c0 + chunk)
                    cu.append(q0 + frame_at[r] + c1)
                    starts.append(k0 + key_at[r])
                    used.append(hist + (new if final else c1))
            if frames > need_frames:  # the padding queries: one piece that sees the trash key
                cu.append(q0 + frames)
                starts.append(k0 + trash)
                used.append(_TRASH)
        starts.append(2 * keys)  # the end of the key axis (flash attention reads starts[s] only, with `used`)
        lengths = [b - a for a, b in zip(cu, cu[1:])]

        def long_(values: list[int], dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        return cls(tuple(news), tuple(hists), tuple(finals), tuple(kept), frames, keys, tuple(frame_at),
                   tuple(key_at), long_(window), long_(tail_at), long_(new_key), long_(cu, torch.int32),
                   long_(starts, torch.int32), long_(used, torch.int32), max(lengths), max(used))

    def visible(self) -> torch.Tensor:
        """(2 frames, 2 keys) bool: which keys each query of the folded axes sees (the pieces as a dense mask)."""
        device = self.cu_queries.device
        cu, starts, used = self.cu_queries.long(), self.piece_keys[:-1].long(), self.piece_used.long()
        piece = torch.repeat_interleave(torch.arange(used.numel(), device=device), cu[1:] - cu[:-1])
        lo, hi = starts[piece], starts[piece] + used[piece]
        slot = torch.arange(2 * self.keys, device=device)
        return (slot >= lo.unsqueeze(1)) & (slot < hi.unsqueeze(1))


def piece_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout,
                    visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of the packed queries (2 frames, heads, d) over the packed keys/values (2 keys, heads, d), piece
    by piece (`PackedLayout`). On a GPU in half precision one variable-length flash attention call; otherwise an
    explicit mask (`visible`, from `layout.visible()` when not given)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, layout.cu_queries, layout.piece_keys, layout.longest_piece, layout.longest_keys, 0.0, False,
            False, seqused_k=layout.piece_used)[0]
        return out
    mask = layout.visible() if visible is None else visible
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask)
    return out[0].transpose(0, 1)


class _PackedConvs:
    """Causal convs over packed frames (2, frames, C) with every row's two tail frames as its left context; the
    tails of all convs travel as one tensor (2, 2 rows, channels of all convs), each conv reading its slice."""

    def __init__(self, tails: torch.Tensor, layout: PackedLayout, weights: dict[int, torch.Tensor]) -> None:
        self.tails, self.layout, self.weights = tails, layout, weights
        self.offset = 0
        self.out: list[torch.Tensor] = []

    def conv(self, conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        channels = x.size(2)
        left = self.tails[:, :, self.offset : self.offset + channels]
        self.offset += channels
        seq = torch.cat([left, x], dim=1)  # (2, 2 rows + frames, C)
        self.out.append(seq.index_select(1, self.layout.tail_at))
        windows = seq.index_select(1, self.layout.window).view(x.size(0), x.size(1), (CONV_CONTEXT + 1) * channels)
        return F.linear(windows, self.weights[id(conv)], conv.bias)

    def collected(self) -> torch.Tensor:
        return torch.cat(self.out, dim=2)  # (2, 2 rows, channels of all convs)


class _PackedBlocks:
    """Transformer blocks over packed frames: each writes its new keys/values into its rows' key slots and attends
    piece by piece (`piece_attention`). `keys` (blocks, 2 k/v, 2 guidance, key slots, heads, d)."""

    def __init__(self, keys: torch.Tensor, layout: PackedLayout, qkv_weights: Sequence[torch.Tensor],
                 visible: Optional[torch.Tensor]) -> None:
        self.keys, self.layout, self.qkv_weights, self.visible = keys, layout, qkv_weights, visible
        self.index = 0

    def run(self, block, x: torch.Tensor) -> torch.Tensor:
        attn = block.attn1
        guidance, frames, _ = x.shape
        qkv = F.linear(block.norm1(x), self.qkv_weights[self.index]).view(guidance, frames, 3, attn.heads,
                                                                          attn.head_dim)
        kv = self.keys[self.index]  # (2 k/v, 2 guidance, key slots, heads, d)
        kv.index_copy_(2, self.layout.new_key_at, qkv[:, :, 1:].permute(2, 0, 1, 3, 4))
        self.index += 1
        flat = (guidance * self.layout.keys, attn.heads, attn.head_dim)
        out = piece_attention(qkv[:, :, 0].reshape(guidance * frames, attn.heads, attn.head_dim),
                              kv[0].view(flat), kv[1].view(flat), self.layout, self.visible)
        x = x + attn.to_out[0](out.reshape(guidance, frames, attn.heads * attn.head_dim))
        return x + block.ff(block.norm3(x))


class PackedFlow:
    """`CachedFlowRunner`'s Euler solve with the call's rows packed (`solve`, the counterpart of `_solve`)."""

    def __init__(self, runner: CachedFlowRunner) -> None:
        self.runner = runner
        est = runner.flow.decoder.estimator
        # causal conv weights as (out, 3 x in) with the tap major: the gathered windows' (tap, channel) order
        self.conv_weights = {id(m): m.weight.detach().permute(0, 2, 1).reshape(m.out_channels, -1)
                             for m in est.modules() if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] == 3}
        self.chunk = est.config.static_chunk_size
        self.blocks = sum(len(stage[1]) for stage in (*est.down_blocks, *est.mid_blocks, *est.up_blocks))
        self.tail_channels = sum(m.in_channels for m in est.modules()
                                 if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] == 3)

    @torch.inference_mode()
    def solve(self, rows: Sequence[CachedRow], mu: torch.Tensor) -> tuple[list[torch.Tensor], list[EstimatorCache]]:
        """Every Euler step of `rows` (encoder output `mu` (rows, 80, frames), as `CachedFlowRunner._encode` gives
        it): each row's mel (80, frames) float32 of tokens[first_emitted:stop] and its new estimator caches."""
        runner, cfm = self.runner, self.runner.flow.decoder
        solving = runner._begin(rows, mu)
        layout = PackedLayout.of([s.new for s in solving], [s.start for s in solving], [r.final for r in rows],
                                 [s.kept for s in solving], self.chunk, mu.device)
        like = solving[0].x
        x = self._pack([s.x for s in solving], layout)  # (80, frames): the ODE state, packed for the whole call
        mask = self._pack([torch.ones_like(s.x[:1]) for s in solving], layout)
        cond_mu = self._pack([s.mu for s in solving], layout)
        cond_spks = self._pack([s.spks.unsqueeze(1).expand(-1, s.new) for s in solving], layout)
        cond_cond = self._pack([s.cond for s in solving], layout)
        zeros = torch.zeros_like(x)
        mask2, mu2 = torch.stack([mask, mask]), torch.stack([cond_mu, zeros])
        spks2, cond2 = torch.stack([cond_spks, zeros]), torch.stack([cond_cond, zeros])
        visible = None if like.is_cuda and like.dtype in (torch.float16, torch.bfloat16) else layout.visible()
        cfg = runner.flow.decoder.estimator.config
        keys = like.new_zeros(self.blocks, 2, 2, layout.keys, cfg.num_heads, cfg.attention_head_dim)
        rate = cfm.config.inference_cfg_rate
        kvs: list[torch.Tensor] = []
        tails_out: list[torch.Tensor] = []
        for step, (t, dt) in enumerate(cfm.schedule):
            self._fill_history(keys, rows, step, layout)
            convs = _PackedConvs(self._tails(rows, step, layout.rows, like), layout, self.conv_weights)
            blocks = _PackedBlocks(keys, layout, runner.fused.qkv, visible)
            t_in = torch.full((2,), t, device=like.device, dtype=like.dtype)
            velocity = runner.network(torch.stack([x, x]), mask2, mu2, t_in, spks2, cond2, convs, blocks)
            x = x + dt * ((1.0 + rate) * velocity[0] - rate * velocity[1])
            if any(layout.kept):  # the new keys of every row's frames, in frame order (a row's kept ones lead)
                kvs.append(keys.index_select(3, layout.new_key_at[: sum(layout.news)]))
            tails_out.append(convs.collected())
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

    @staticmethod
    def _pack(pieces: Sequence[torch.Tensor], layout: PackedLayout) -> torch.Tensor:
        """Per-row (C, new) tensors -> (C, frames), padding zeroed."""
        out = pieces[0].new_zeros(pieces[0].size(0), layout.frames)
        for piece, at in zip(pieces, layout.frame_at):
            out[:, at : at + piece.size(1)] = piece
        return out

    def _fill_history(self, keys: torch.Tensor, rows: Sequence[CachedRow], step: int, layout: PackedLayout) -> None:
        """Each row's history keys/values at this Euler step into its key slots (prefix, then its own)."""
        for row, at in zip(rows, layout.key_at):
            for segment in (row.prefix, row.own):
                if segment.estimator.frames:
                    piece = segment.estimator.kv[step]  # (blocks, 2, 2, n, heads, d)
                    keys[:, :, :, at : at + piece.size(3)] = piece
                    at += piece.size(3)

    def _tails(self, rows: Sequence[CachedRow], step: int, count: int, like: torch.Tensor) -> torch.Tensor:
        """(2, 2 rows, channels of all convs): each row's last two inputs of every causal conv before its new frames
        (zeros without history)."""
        out = like.new_zeros(2, CONV_CONTEXT * count, self.tail_channels)
        for r, row in enumerate(rows):
            segment = row.own if row.own.estimator.frames else row.prefix
            if segment.estimator.frames:  # (2, channels, 2) -> (2, 2, channels)
                out[:, CONV_CONTEXT * r : CONV_CONTEXT * (r + 1)] = segment.estimator.tails[step].transpose(1, 2)
        return out
