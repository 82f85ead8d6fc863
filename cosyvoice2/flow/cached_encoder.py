"""The encoder pass of the chunk-cached flow (`cached.CachedFlowRunner`): new tokens -> mu, over cached keys/values.

One pass runs the lookahead conv over the new tokens, the conformer layers over tokens (keys/values of the history
cached), the causal upsampling (the last 2 token states of the history as left context) and the up layers over
frames. It is a few hundred small kernels, so it is split in two:

* `prepare` (host side) pads a call to a static shape (rows, new tokens, history tokens): token ids gathered in
  one indexed copy, per-row bounds as one small tensor, the up layer's left context, and the rows' cached
  keys/values copied into one key buffer whose first `history` positions hold each row's history;
* `CachedEncoder.forward` is static-shape and host-sync free - masks and relative positions are built on the
  device from the per-row bounds - so a CUDA graph per shape bucket can replay it (`EncoderGraphs`).

Padding is exact: padded tokens are zero inputs and hidden as attention keys; padded rows see no keys at all (their
outputs are discarded); every conv is causal or reads only its own row's positions. The buffer's padding holds
stale but finite values (earlier calls' keys), always hidden, so it never reaches a real row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from speech_lm.graph_buckets import GridGraphs, on_device
from speech_lm.kernels import copy_runs
from ..host_copies import to_device
from .encoder import relative_positions

if TYPE_CHECKING:
    from .cached import CachedRow

PRE_LOOKAHEAD_LEFT = 2  # the lookahead layer's second conv (kernel 3, causal) reads 2 earlier positions
UP_CONTEXT = 2  # the upsampling conv's left context, in tokens


@dataclass
class EncoderCache:
    tokens: int = 0  # tokens encoded (always on the 25-token grid)
    kv: Optional[torch.Tensor] = None  # (layers, 2, heads, tokens, head_dim)
    up_kv: Optional[torch.Tensor] = None  # (up layers, 2, heads, 2 tokens, head_dim)
    up_tail: Optional[torch.Tensor] = None  # (width, 2): last 2 token states before upsampling


@dataclass(eq=False)
class EncoderInputs:
    """The padded inputs of one encoder pass (`CachedEncoder.prepare`); the key buffers are filled separately
    (`CachedEncoder.gather_history`), into a fresh buffer or a graph's static one."""

    shape: tuple[int, int, int]  # (rows, new tokens, history tokens) after padding
    ids: torch.Tensor  # (rows, 2 + new + lookahead) token ids: 2 earlier tokens, new tokens, lookahead context
    # (rows, 5) int64: first and end position of real ids, history tokens, new tokens, final (1) or not (0)
    bounds: torch.Tensor
    tails: torch.Tensor  # (rows, width, 2) the up layer's left context


class CachedEncoder:
    """The flow's encoder over new tokens with per-row caches; rows of different histories in one padded pass."""

    def __init__(self, flow: torch.nn.Module, graphs: bool = True,
                 row_buckets: Sequence[int] = (1, 2, 4, 8, 16)) -> None:
        self.flow = flow
        encoder = flow.encoder
        self.stride = flow.config.token_mel_ratio
        self.lookahead = flow.config.pre_lookahead_len
        self.grid = flow.config.encoder.static_chunk_size
        self.width = flow.config.encoder.width
        attn = encoder.encoders[0].self_attn
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.graphs: Optional[EncoderGraphs] = EncoderGraphs(self, rows=row_buckets) if graphs else None

    # -- one call ------------------------------------------------------------------------------------------
    def run(self, rows: Sequence["CachedRow"]) -> tuple[torch.Tensor, list[EncoderCache]]:
        """mu (rows, 80, 2 x padded new tokens) and the caches each row keeps (its whole grid chunks)."""
        device = self.flow.input_embedding.weight.device
        dtype = self.flow.input_embedding.weight.dtype
        news = [row.stop - row.start for row in rows]
        hist = [row.start for row in rows]
        graphs = self.graphs
        shape = None
        if graphs is not None and (device.type == "cuda" or graphs.emulate):
            shape = graphs.bucket(len(rows), max(news), max(hist))
        if shape is not None:
            return graphs.run(shape, rows, self.prepare(rows, shape, device, dtype))  # type: ignore[union-attr]
        inputs = self.prepare(rows, (len(rows), max(news), max(hist)), device, dtype)
        kv, up_kv = self.key_buffers(inputs.shape, device, dtype)
        self.gather_history(rows, kv, up_kv)
        mu, seq = self.forward(inputs.ids, inputs.bounds, inputs.tails, kv, up_kv, inputs.shape[2])
        return mu, self.kept(rows, seq, kv, up_kv, inputs.shape[2])

    def prepare(self, rows: Sequence["CachedRow"], shape: tuple[int, int, int], device: torch.device,
                dtype: torch.dtype) -> EncoderInputs:
        """The ids, bounds and up-layer context of `rows` padded to `shape` (rows, new tokens, history tokens)."""
        rows_p, new_p, _ = shape
        left = PRE_LOOKAHEAD_LEFT
        span = left + new_p + self.lookahead
        # one index into all rows' tokens laid end to end: a single gather instead of a copy per row
        index = np.zeros((rows_p, span), dtype=np.int64)
        bounds = np.zeros((rows_p, 5), dtype=np.int64)
        base = 0
        for b, row in enumerate(rows):
            first = max(0, row.start - left)
            end = row.stop + (0 if row.final else self.lookahead)
            offset = left - (row.start - first)  # a row starting at token 0 has no earlier tokens: zeros there
            index[b, offset : offset + end - first] = np.arange(base + first, base + end)
            bounds[b] = (offset, offset + end - first, row.start, row.stop - row.start, int(row.final))
            base += row.tokens.numel()
        flat = torch.cat([row.tokens.view(-1) for row in rows]).to(device)
        ids = flat[to_device(index, device)]
        none = torch.zeros(self.width, UP_CONTEXT, dtype=dtype, device=device)  # no history: zeros, as upstream
        tails = [row.own.encoder.up_tail if row.own.encoder.up_tail is not None else row.prefix.encoder.up_tail
                 for row in rows]
        tails = torch.stack([none if t is None else t for t in tails] + [none] * (rows_p - len(rows)))
        return EncoderInputs(shape, ids, to_device(bounds, device), tails)

    def key_buffers(self, shape: tuple[int, int, int], device: torch.device,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key/value buffers (layers, 2, rows, heads, history + new, head_dim), tokens then frames."""
        rows_p, new_p, hist_p = shape
        encoder = self.flow.encoder
        kv = torch.zeros(len(encoder.encoders), 2, rows_p, self.heads, hist_p + new_p, self.head_dim,
                         dtype=dtype, device=device)
        up_kv = torch.zeros(len(encoder.up_encoders), 2, rows_p, self.heads, self.stride * (hist_p + new_p),
                            self.head_dim, dtype=dtype, device=device)
        return kv, up_kv

    @staticmethod
    def gather_history(rows: Sequence["CachedRow"], kv: torch.Tensor, up_kv: torch.Tensor) -> None:
        """Each row's cached keys/values (voice prefix, then its own) into the first positions of its buffer row.
        Consecutive rows of one voice get the prefix in one broadcast copy; every copy is a strided view of
        contiguous (positions x head_dim) runs (`copy_runs`)."""
        b = 0
        while b < len(rows):
            prefix = rows[b].prefix.encoder
            last = b
            while last + 1 < len(rows) and rows[last + 1].prefix.encoder is prefix:
                last += 1
            if prefix.tokens:
                for out, piece in ((kv, prefix.kv), (up_kv, prefix.up_kv)):
                    copy_runs(out[:, :, b : last + 1, :, : piece.size(3)], piece.unsqueeze(2))
            b = last + 1
        for b, row in enumerate(rows):
            own, at = row.own.encoder, row.prefix.encoder.tokens
            if own.tokens:
                copy_runs(kv[:, :, b, :, at : at + own.tokens], own.kv)
                stride = up_kv.size(4) // kv.size(4)
                copy_runs(up_kv[:, :, b, :, stride * at : stride * (at + own.tokens)], own.up_kv)

    def kept(self, rows: Sequence["CachedRow"], seq: torch.Tensor, kv: torch.Tensor, up_kv: torch.Tensor,
             hist_p: int) -> list[EncoderCache]:
        """The caches each row keeps, copied out of the pass's buffers (which a graph's next replay overwrites)."""
        out = []
        for b, row in enumerate(rows):
            kept = row.kept_tokens(self.grid)
            if not kept:
                out.append(EncoderCache())
                continue
            own_kv = kv.new_empty(kv.size(0), 2, kv.size(3), kept, kv.size(5))
            copy_runs(own_kv, kv[:, :, b, :, hist_p : hist_p + kept])
            up = self.stride
            own_up = up_kv.new_empty(up_kv.size(0), 2, up_kv.size(3), up * kept, up_kv.size(5))
            copy_runs(own_up, up_kv[:, :, b, :, up * hist_p : up * (hist_p + kept)])
            out.append(EncoderCache(kept, own_kv, own_up, seq[b, :, kept : kept + UP_CONTEXT].clone()))
        return out

    # -- the static-shape pass ---------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, bounds: torch.Tensor, tails: torch.Tensor, kv: torch.Tensor,
                up_kv: torch.Tensor, hist_p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> mu (rows, 80, 2 new) and the token states before upsampling with their left context (rows, width,
        2 + new). Writes the new keys/values into kv / up_kv after the first hist_p (tokens) positions. Static
        shapes, no host syncs: CUDA-graph safe."""
        flow, encoder = self.flow, self.flow.encoder
        left = PRE_LOOKAHEAD_LEFT
        span = ids.size(1)
        new_p = span - left - self.lookahead
        first, end, hist, news, finals = bounds.unbind(1)
        position = torch.arange(span, device=ids.device)
        keep = (position >= first.unsqueeze(1)) & (position < end.unsqueeze(1))  # positions holding a real token
        x = encoder.embed(flow.input_embedding(ids.clamp(min=0))) * keep.unsqueeze(-1).to(tails.dtype)
        pre = encoder.pre_lookahead_layer
        h = F.leaky_relu(pre.conv1(x.transpose(1, 2)), negative_slope=0.01)  # (B, W, span - lookahead)
        # upstream pads the second conv's input with zeros on the left: a row starting at token 0 has no history
        h = h * keep[:, : h.size(2)].unsqueeze(1).to(h.dtype)
        h = pre.conv2(h)  # (B, W, new_p): outputs for the new tokens
        x = h.transpose(1, 2) + x[:, left : left + new_p]

        finals = finals.bool()
        x = self._conformer(encoder.encoders, x, kv, hist_p, hist, news, finals, self.grid)
        seq = torch.cat([tails, x.transpose(1, 2)], dim=2)  # (B, W, 2 + new_p): causal upsampling's context
        # nearest-neighbour repeat as a broadcast (`repeat_interleave` may build an index with a host sync)
        repeated = seq.unsqueeze(-1).expand(-1, -1, -1, self.stride).flatten(2)
        x = encoder.up_layer.conv(repeated).transpose(1, 2)  # (B, 2 new_p, W)
        x = encoder.up_embed(x)
        up = self.stride
        x = self._conformer(encoder.up_encoders, x, up_kv, up * hist_p, up * hist, up * news, finals,
                            up * self.grid)
        mu = flow.encoder_proj(encoder.after_norm(x)).transpose(1, 2)
        return mu, seq

    @staticmethod
    def _conformer(layers: torch.nn.ModuleList, x: torch.Tensor, kv: torch.Tensor, hist_p: int,
                   hist: torch.Tensor, news: torch.Tensor, finals: torch.Tensor, chunk: int) -> torch.Tensor:
        """Conformer layers over x (B, new_p, W) at positions hist[b].. of each row. Keys: kv (layers, 2, B, H,
        hist_p + new_p, D) holds each row's history in its first hist[b] positions (the rest up to hist_p is
        padding); each layer writes its new keys/values after hist_p and attends to the whole buffer row."""
        batch, new_p, width = x.shape
        device = x.device
        total = hist_p + new_p
        slot = torch.arange(total, device=device)
        is_new = slot >= hist_p
        new_index = slot - hist_p
        key_pos = torch.where(is_new, hist.unsqueeze(1) + new_index, slot)  # (B, total) absolute key position
        query_pos = hist.unsqueeze(1) + torch.arange(new_p, device=device)  # (B, new_p)
        real_key = torch.where(is_new, new_index < news.unsqueeze(1), slot < hist.unsqueeze(1))
        same_or_earlier = (key_pos // chunk).unsqueeze(1) <= (query_pos // chunk).unsqueeze(2)  # (B, Nq, total)
        visible = (real_key.unsqueeze(1) & (same_or_earlier | finals.view(-1, 1, 1))).unsqueeze(1)
        # a real pair's distance query - key lies in [-(new_p - 1), total - 1]: a table of those distances
        # (row c = distance total - 1 - c); padded pairs are clamped into it (they are hidden)
        distance = query_pos.unsqueeze(2) - key_pos.unsqueeze(1)
        column = ((total - 1) - distance).clamp(0, total + new_p - 2)
        pos_table = relative_positions(total, new_p, width, device, x.dtype)
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            q, k_new, v_new = attn.project(layer.norm_mha(x))  # (B, H, new_p, D)
            keys, values = kv[index, 0], kv[index, 1]
            keys[:, :, hist_p:].copy_(k_new)
            values[:, :, hist_p:].copy_(v_new)
            x = x + attn.attend(q, keys, values, pos_table, column, visible)
            x = x + layer.feed_forward(layer.norm_ff(x))
        return x


_EncoderStatics = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, bounds, tails
_KeyBuffers = tuple[torch.Tensor, torch.Tensor]  # keys/values of the conformer stacks before and after upsampling


class EncoderGraphs(GridGraphs[_EncoderStatics, tuple[torch.Tensor, torch.Tensor], _KeyBuffers]):
    """CUDA graphs of the cached encoder pass, per (rows, new tokens, history tokens) bucket.

    The buckets cover every call of the served schedules (`tests/engine/test_encoder_graphs.py`): rows as the
    `cached.encoder_rows`, new tokens 32/64/128 (a first chunk is at most 77 tokens, a later or final one at most
    126), history every 128 tokens up to 1024 (2048 frames, `packed.LONGEST_HISTORY`). The rows' history is copied before
    each replay into one static key buffer per layer stack that every graph views; outputs (mu, seq) live in the
    graphs' own pool and are copied out under the lock, before the next replay. Calls that fit no bucket run eagerly.
    """

    def __init__(self, encoder: CachedEncoder, rows: Sequence[int] = (1, 2, 4, 8, 16),
                 new_tokens: Sequence[int] = (32, 64, 128),
                 history_tokens: Sequence[int] = (128, 256, 384, 512, 640, 768, 1024)) -> None:
        super().__init__()
        self.encoder = encoder
        self.rows, self.new_tokens, self.history_tokens = tuple(rows), tuple(new_tokens), tuple(history_tokens)

    def sizes(self) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
        return self.rows, self.new_tokens, self.history_tokens

    def __len__(self) -> int:
        return len(self._captured)

    def run(self, shape: tuple[int, int, int], rows: Sequence["CachedRow"],
            inputs: EncoderInputs) -> tuple[torch.Tensor, list[EncoderCache]]:
        device = inputs.ids.device
        with self._lock, on_device(device):
            captured = self._get(shape, device, inputs.tails.dtype)
            kv, up_kv = self._views(shape)
            self.encoder.gather_history(rows, kv, up_kv)
            for static, value in zip(captured.inputs, (inputs.ids, inputs.bounds, inputs.tails)):
                static.copy_(value)
            if captured.graph is None:
                mu, seq = self.encoder.forward(*captured.inputs, kv, up_kv, shape[2])
            else:
                captured.graph.replay()
                mu, seq = captured.outputs  # type: ignore[misc]
            return mu[: len(rows)].clone(), self.encoder.kept(rows, seq, kv, up_kv, shape[2])

    def _views(self, shape: tuple[int, int, int]) -> _KeyBuffers:
        rows_p, new_p, hist_p = shape
        assert self._buffers is not None
        kv, up_kv = self._buffers
        up = self.encoder.stride
        return kv[:, :, :rows_p, :, : hist_p + new_p], up_kv[:, :, :rows_p, :, : up * (hist_p + new_p)]

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> _KeyBuffers:
        largest = (max(self.rows), max(self.new_tokens), max(self.history_tokens))
        return self.encoder.key_buffers(largest, device, dtype)

    def _inputs(self, shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> _EncoderStatics:
        rows_p, new_p, _ = shape
        encoder = self.encoder
        return (
            torch.zeros(rows_p, PRE_LOOKAHEAD_LEFT + new_p + encoder.lookahead, dtype=torch.long, device=device),
            torch.zeros(rows_p, 5, dtype=torch.long, device=device),
            torch.zeros(rows_p, encoder.width, UP_CONTEXT, dtype=dtype, device=device),
        )

    def _pass(self, shape: tuple[int, int, int],
              inputs: _EncoderStatics) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        kv, up_kv = self._views(shape)
        return lambda: self.encoder.forward(*inputs, kv, up_kv, shape[2])
