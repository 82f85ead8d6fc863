"""UpsampleConformerEncoder: 25 Hz token embeddings -> 50 Hz hidden states (docs/reference/cosyvoice2.md#encoder).

Key layout follows upstream flow.pt (`embed.out.{0,1}`, `encoders.N.self_attn.linear_q`, ...).
Rows of different lengths are right-padded and given `lengths`: attention hides the padded keys, the
lookahead convolution sees each row's own context (or zeros) right after its end, and everything else is
per-frame or causal, so a row's real frames equal those of running it alone.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .masks import chunk_visibility

_EMBED_LN_EPS = 1e-5
_LAYER_LN_EPS = 1e-12


def relative_positions(keys: int, queries: int, width: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """ESPnet relative-position encodings for the distances that `queries` queries at the end of `keys` keys
    see: keys - 1 ... -(queries - 1), shape (1, keys + queries - 1, width); offline (keys = queries = T) that is
    the 2T - 1 rows of the whole table, a chunk needs only its own queries' rows.

    Even channels sin, odd channels cos of distance x 10000^(-2i/width), evaluated in float32 the way the
    reference builds its table, so the values match it bit for bit.
    """
    inv_freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32, device=device)
                         * -(math.log(10000.0) / width))
    distance = torch.arange(keys - 1, -queries, -1, dtype=torch.float32, device=device)
    angle = distance[:, None] * inv_freq[None, :]
    table = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).flatten(1)  # even sin, odd cos
    return table.unsqueeze(0).to(dtype)


def relative_position_table(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The whole table for `length` positions: distances length-1 .. -(length-1), shape (1, 2*length-1, dim)."""
    return relative_positions(length, length, dim, device, dtype)


def trailing_query_columns(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """(queries, keys) index into a `relative_positions(keys, queries)` table for queries that are the last
    `queries` of `keys` positions: query i sits at keys - queries + i, and table row c holds distance
    (keys - 1) - c, so [i, j] picks the row of distance (keys - queries + i) - j."""
    query = torch.arange(queries, device=device)[:, None]
    key = torch.arange(keys, device=device)[None, :]
    return (queries - 1) - query + key


def _length_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """(B,) lengths -> (B, length) bool, True on each row's real frames."""
    return torch.arange(length, device=lengths.device) < lengths.unsqueeze(1)


class LinearEmbedding(nn.Module):
    """Linear -> LayerNorm -> scale by sqrt(width); positions are supplied separately (not scaled)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width, eps=_EMBED_LN_EPS))
        self.xscale = math.sqrt(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionAttention(nn.Module):
    """Transformer-XL style self-attention with learned u/v biases (ESPnet `rel_selfattn`), for whole
    sequences, for chunks that continue a key/value cache, and (`project` + `attend`) for ragged batches whose
    rows sit at different positions (the cached streaming flow)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(width, width)
        self.linear_v = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.linear_pos = nn.Linear(width, width, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, W) -> queries, keys, values, each (B, H, T, D)."""
        return self._heads(self.linear_q(x)), self._heads(self.linear_k(x)), self._heads(self.linear_v(x))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               column: torch.Tensor, visible: Optional[torch.Tensor]) -> torch.Tensor:
        """q (B, H, T, D) against k, v (B, H, L, D); positions (1, R, W) a relative-position table and column
        (T, L) or (B, T, L) the table row of each query/key pair; visible broadcastable to (B, H, T, L) bool or
        None for all. Returns (B, T, W)."""
        batch, _, length, _ = q.shape
        p = self._heads(self.linear_pos(positions))  # (1, H, R, D)
        content = torch.matmul(q + self.pos_bias_u[:, None], k.transpose(-2, -1))
        by_row = torch.matmul(q + self.pos_bias_v[:, None], p.transpose(-2, -1))  # (B, H, T, R)
        column = column.unsqueeze(-3) if column.dim() == 3 else column  # per row: (B, 1, T, L)
        position = by_row.gather(-1, column.expand(batch, self.heads, length, k.size(2)))
        scores = (content + position) / math.sqrt(self.head_dim)
        if visible is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            hidden = ~visible
            weights = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1).masked_fill(hidden, 0.0)
        return self.linear_out(torch.matmul(weights, v).transpose(1, 2).reshape(batch, length, -1))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, visible: Optional[torch.Tensor],
                cache: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, W) queries at absolute positions cached .. cached + T - 1; positions (1, L + T - 1, W) for
        L = cached + T keys (`relative_positions(L, T)`); visible broadcastable to (B, 1, T, L) bool or None;
        cache (B, H, cached, 2D) keys || values or None.

        Returns the output (B, T, W) and the cache after it (B, H, L, 2D) = [cache || this chunk's keys/values].
        """
        q, k, v = self.project(x)
        if cache is not None and cache.size(2) > 0:
            cached_k, cached_v = cache.split(self.head_dim, dim=-1)
            k, v = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
        column = trailing_query_columns(x.size(1), k.size(2), x.device)
        return self.attend(q, k, v, positions, column, visible), torch.cat([k, v], dim=-1)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(width, hidden)
        self.w_2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-LN layer without macaron FFN or convolution module: attention then feed-forward, both residual."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(width, heads)
        self.feed_forward = PositionwiseFeedForward(width, hidden)
        self.norm_ff = nn.LayerNorm(width, eps=_LAYER_LN_EPS)
        self.norm_mha = nn.LayerNorm(width, eps=_LAYER_LN_EPS)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, visible: Optional[torch.Tensor],
                cache: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over x (B, T, W); see `RelPositionAttention.forward` for the arguments. Returns the output
        and the attention's cache after it."""
        attended, new_cache = self.self_attn(self.norm_mha(x), positions, visible, cache)
        x = x + attended
        return x + self.feed_forward(self.norm_ff(x)), new_cache


class PreLookaheadLayer(nn.Module):
    """Residual conv pair giving every frame `lookahead` frames of right context (zeros at the end of input).

    `channels`: width between the two convs (default `width`; CosyVoice3's flow widens it, 80 -> 1024 -> 80)."""

    def __init__(self, width: int, lookahead: int, channels: Optional[int] = None) -> None:
        super().__init__()
        self.lookahead = lookahead
        channels = width if channels is None else channels
        self.conv1 = nn.Conv1d(width, channels, lookahead + 1)
        self.conv2 = nn.Conv1d(channels, width, 3)

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor], lengths: torch.Tensor) -> torch.Tensor:
        """x (B, T, W) with `lengths` (B,) real frames per row; context (B, lookahead, W) follows each row's end."""
        h = x.transpose(1, 2) * _length_mask(lengths, x.size(1)).unsqueeze(1)  # zeros after each row's end
        h = F.pad(h, (0, self.lookahead))
        if context is not None:
            if context.size(1) != self.lookahead:
                raise ValueError(f"lookahead context must have {self.lookahead} frames, got {context.size(1)}")
            after_end = lengths.unsqueeze(1) + torch.arange(self.lookahead, device=x.device)  # (B, lookahead)
            h = h.scatter(2, after_end.unsqueeze(1).expand(-1, h.size(1), -1), context.transpose(1, 2))
        h = F.leaky_relu(self.conv1(h), negative_slope=0.01)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class Upsample1D(nn.Module):
    """Nearest-neighbour repeat by `stride`, then a causal conv (left pad 2*stride, kernel 2*stride+1)."""

    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(width, width, 2 * stride + 1)

    @property
    def context(self) -> int:
        """Left context of the causal conv, in upsampled frames."""
        return 2 * self.stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.repeat_interleave(self.stride, dim=2)
        return self.conv(F.pad(h, (self.context, 0)))


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        width = config.width
        self.embed = LinearEmbedding(width)
        self.pre_lookahead_layer = PreLookaheadLayer(width, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerLayer(width, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)
        )
        self.up_layer = Upsample1D(width, config.upsample_stride)
        self.up_embed = LinearEmbedding(width)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(width, config.attention_heads, config.linear_units) for _ in range(config.num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(width, eps=_EMBED_LN_EPS)

    @staticmethod
    def _visibility(length: int, chunk_size: int, streaming: bool, lengths: Optional[torch.Tensor],
                    device: torch.device) -> Optional[torch.Tensor]:
        """Which keys each query sees: (L, L), (B, 1, 1, L) or (B, 1, L, L) bool, or None for all."""
        visible = chunk_visibility(length, chunk_size, device) if streaming else None
        if lengths is not None:
            keys = _length_mask(lengths, length)[:, None, None, :]
            visible = keys if visible is None else visible & keys
        return visible

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None, streaming: bool = False,
                lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, W) token embeddings, context (B, lookahead, W) or None -> (B, stride*T, W).

        lengths (B,): real frames per right-padded row (None: all T); output row b is real up to stride*lengths[b].
        """
        cfg = self.config
        length = x.size(1)
        x = self.embed(x)
        if context is not None:
            context = self.embed(context)
        pos_table = relative_position_table(length, cfg.width, x.device, x.dtype)
        visible = self._visibility(length, cfg.static_chunk_size, streaming, lengths, x.device)
        full = torch.full((x.size(0),), length, dtype=torch.long, device=x.device)
        x = self.pre_lookahead_layer(x, context, full if lengths is None else lengths)
        for layer in self.encoders:
            x, _ = layer(x, pos_table, visible)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        length = x.size(1)
        x = self.up_embed(x)
        pos_table = relative_position_table(length, cfg.width, x.device, x.dtype)
        up_lengths = None if lengths is None else lengths * cfg.upsample_stride
        visible = self._visibility(length, cfg.static_chunk_size * cfg.upsample_stride, streaming, up_lengths,
                                   x.device)
        for layer in self.up_encoders:
            x, _ = layer(x, pos_table, visible)
        return self.after_norm(x)
