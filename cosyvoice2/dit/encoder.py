"""UpsampleConformerEncoderV2: 25 Hz speech-token embeddings -> 50 Hz hidden states, offline or chunk by chunk.

Keys follow the released flow.pt (`encoder.embed.out.{0,1}`, `encoder.encoders.N.self_attn.linear_q`, ...).

Offline (`forward`): every row of a right-padded batch sees only its own frames (key-padding masks; the
lookahead convolution reads zeros right after each row's end), bidirectional attention.

Chunked (`forward_chunk`): one stream's chunk of tokens continues the state in an `EncoderCache`:
- the lookahead convolution is not padded: a non-final chunk of n tokens yields n - lookahead frames, its last
  `lookahead` tokens are context only (they are sent again as ordinary tokens with the next chunk); the final
  chunk is padded with `lookahead` zero frames (after the embedding) and yields all n;
- the second lookahead conv and the upsampling conv take their left context from the cache (2 and 4 frames);
- every conformer layer attends from the chunk to [cached keys/values || chunk], unmasked, with relative
  positions measured from each query's absolute position. The cache grows with the stream; it is never trimmed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..flow.encoder import LinearEmbedding, PositionwiseFeedForward  # the same layers as the UNet flow's encoder
from .config import DiTEncoderConfig

_EMBED_LN_EPS = 1e-5
_LAYER_LN_EPS = 1e-12
_LEAKY_SLOPE = 0.01
_LOOKAHEAD_CONV2_CONTEXT = 2  # kernel 3, left-padded by 2


def relative_positions(keys: int, queries: int, width: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """ESPnet relative-position encodings for the distances that `queries` queries at the end of `keys` keys
    see: keys - 1 ... -(queries - 1), shape (1, keys + queries - 1, width) (offline, keys = queries: 2T - 1 rows;
    a chunk needs only its own queries' rows, not the 2 L - 1 rows of the whole table).

    Even channels sin, odd channels cos of distance x 10000^(-2i/width), evaluated in float32 (the values of
    the reference's table rows, whatever range is taken).
    """
    inv_freq = torch.exp(torch.arange(0, width, 2, dtype=torch.float32, device=device)
                         * -(math.log(10000.0) / width))
    distance = torch.arange(keys - 1, -queries, -1, dtype=torch.float32, device=device)
    angle = distance[:, None] * inv_freq[None, :]
    table = torch.empty(keys + queries - 1, width, dtype=torch.float32, device=device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.unsqueeze(0).to(dtype)


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with learned u/v position biases (Transformer-XL / ESPnet `rel_selfattn`)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(width, width)
        self.linear_v = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.linear_pos = nn.Linear(width, width, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.head_dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_mask: Optional[torch.Tensor],
                cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, W) queries at absolute positions cached .. cached + T - 1; positions (1, L + T - 1, W) for
        L = cached + T keys (`relative_positions(L, T)`); key_mask (B, 1, 1, L) bool or None; cache (B, H, cached, 2D) keys || values.

        Returns the output (B, T, W) and the new cache (B, H, L, 2D) = [cache || this chunk's keys/values].
        """
        batch, length, width = x.shape
        q = self._heads(self.linear_q(x))
        k = self._heads(self.linear_k(x))
        v = self._heads(self.linear_v(x))
        if cache is not None and cache.shape[2] > 0:
            cached_k, cached_v = cache.split(self.head_dim, dim=-1)
            k, v = torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)
        keys = k.shape[2]
        p = self._heads(self.linear_pos(positions))  # (1, H, 2L - 1, D)
        content = torch.matmul(q + self.pos_bias_u[:, None], k.transpose(-2, -1))
        by_row = torch.matmul(q + self.pos_bias_v[:, None], p.transpose(-2, -1))  # (B, H, T, L + T - 1)
        # query i sits at absolute position keys - length + i; table row c holds distance (keys - 1) - c
        query = torch.arange(length, device=x.device)[:, None]
        key = torch.arange(keys, device=x.device)[None, :]
        column = (length - 1) - query + key
        position = by_row.gather(-1, column.expand(batch, self.heads, length, keys))
        scores = (content + position) / math.sqrt(self.head_dim)
        if key_mask is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            hidden = ~key_mask
            weights = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(batch, length, width)
        return self.linear_out(out), new_cache


class ConformerLayer(nn.Module):
    """Pre-LN attention then feed-forward, both residual (no macaron FFN, no convolution module)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelPositionAttention(width, heads)
        self.feed_forward = PositionwiseFeedForward(width, hidden)
        self.norm_ff = nn.LayerNorm(width, eps=_LAYER_LN_EPS)
        self.norm_mha = nn.LayerNorm(width, eps=_LAYER_LN_EPS)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, key_mask: Optional[torch.Tensor],
                cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        attended, new_cache = self.self_attn(self.norm_mha(x), positions, key_mask, cache)
        x = x + attended
        return x + self.feed_forward(self.norm_ff(x)), new_cache


class PreLookaheadLayer(nn.Module):
    """conv1 (kernel lookahead + 1, reads ahead) -> leaky ReLU -> causal conv2 (kernel 3) -> residual."""

    def __init__(self, width: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(width, width, lookahead + 1)
        self.conv2 = nn.Conv1d(width, width, 3)


class Upsample(nn.Module):
    """Nearest-neighbour repeat by `stride`, then a causal conv (kernel 2 stride + 1, left context 2 stride)."""

    def __init__(self, width: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(width, width, 2 * stride + 1)

    @property
    def context(self) -> int:
        return 2 * self.stride


@dataclass(frozen=True)
class EncoderCache:
    """One stream's encoder state after a chunk (tensors are never modified in place, so a cache can be shared).

    lookahead: (B, W, 2) the last conv1 outputs (conv2's left context);
    upsample: (B, W, 2 stride) the last upsampled inputs of the up conv;
    lower: (layers, B, H, tokens, 2D) keys || values of the token-rate layers;
    upper: (up layers, B, H, frames, 2D) keys || values of the frame-rate layers.
    """

    lookahead: torch.Tensor
    upsample: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.lower.shape[3])

    def select(self, rows: slice) -> "EncoderCache":
        return EncoderCache(self.lookahead[rows], self.upsample[rows], self.lower[:, rows], self.upper[:, rows])


class UpsampleConformerEncoderV2(nn.Module):
    def __init__(self, config: DiTEncoderConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.embed = LinearEmbedding(w)
        self.pre_lookahead_layer = PreLookaheadLayer(w, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(w, config.attention_heads, config.linear_units)
                                      for _ in range(config.num_blocks))
        self.up_layer = Upsample(w, config.upsample_stride)
        self.up_embed = LinearEmbedding(w)
        self.up_encoders = nn.ModuleList(ConformerLayer(w, config.attention_heads, config.linear_units)
                                         for _ in range(config.num_up_blocks))
        self.after_norm = nn.LayerNorm(w, eps=_EMBED_LN_EPS)

    def _positions(self, keys: int, queries: int, like: torch.Tensor) -> torch.Tensor:
        if keys > self.config.max_positions:
            raise ValueError(f"encoder context of {keys} positions exceeds the relative-position table "
                             f"({self.config.max_positions}): the stream is too long")
        return relative_positions(keys, queries, self.config.width, like.device, like.dtype)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Offline: x (B, T, W) token embeddings, right-padded, `lengths` (B,) -> (B, stride T, W)."""
        cfg = self.config
        frames = x.shape[1]
        real = torch.arange(frames, device=x.device)[None, :] < lengths[:, None]  # (B, T)
        x = self.embed(x)
        lookahead = self.pre_lookahead_layer
        h = (x * real[:, :, None]).transpose(1, 2)  # zeros right after each row's end
        h = F.leaky_relu(lookahead.conv1(F.pad(h, (0, lookahead.lookahead))), _LEAKY_SLOPE)
        h = lookahead.conv2(F.pad(h, (_LOOKAHEAD_CONV2_CONTEXT, 0)))
        x = h.transpose(1, 2) + x
        positions = self._positions(frames, frames, x)
        mask = real[:, None, None, :]
        for layer in self.encoders:
            x, _ = layer(x, positions, mask, None)
        up = self.up_layer
        h = x.transpose(1, 2).repeat_interleave(up.stride, dim=2)
        x = up.conv(F.pad(h, (up.context, 0))).transpose(1, 2)
        x = self.up_embed(x)
        positions = self._positions(x.shape[1], x.shape[1], x)
        mask = real.repeat_interleave(up.stride, dim=1)[:, None, None, :]
        for layer in self.up_encoders:
            x, _ = layer(x, positions, mask, None)
        return self.after_norm(x)

    def empty_cache(self, batch: int, like: torch.Tensor) -> EncoderCache:
        cfg = self.config
        w, heads, d = cfg.width, cfg.attention_heads, cfg.head_dim
        return EncoderCache(
            lookahead=like.new_zeros(batch, w, _LOOKAHEAD_CONV2_CONTEXT),
            upsample=like.new_zeros(batch, w, self.up_layer.context),
            lower=like.new_zeros(cfg.num_blocks, batch, heads, 0, 2 * d),
            upper=like.new_zeros(cfg.num_up_blocks, batch, heads, 0, 2 * d))

    def forward_chunk(self, x: torch.Tensor, cache: Optional[EncoderCache],
                      last: bool) -> tuple[torch.Tensor, EncoderCache]:
        """x (B, n, W) embeddings of a chunk's tokens -> (B, stride (n - lookahead), W), or (B, stride n, W) for
        the last chunk, and the cache after it."""
        cfg = self.config
        lookahead = self.pre_lookahead_layer
        if cache is None:
            cache = self.empty_cache(x.shape[0], x)
        x = self.embed(x)
        if last:
            x = F.pad(x, (0, 0, 0, lookahead.lookahead))
        if x.shape[1] <= lookahead.lookahead:
            raise ValueError(f"a chunk needs more than {lookahead.lookahead} tokens (lookahead), got "
                             f"{x.shape[1]}")
        h = F.leaky_relu(lookahead.conv1(x.transpose(1, 2)), _LEAKY_SLOPE)  # n - lookahead frames
        new_lookahead = torch.cat([cache.lookahead, h], dim=2)[:, :, -_LOOKAHEAD_CONV2_CONTEXT:]
        h = lookahead.conv2(torch.cat([cache.lookahead, h], dim=2))
        x = h.transpose(1, 2) + x[:, : h.shape[2]]

        positions = self._positions(cache.lower.shape[3] + x.shape[1], x.shape[1], x)
        lower = []
        for layer, layer_cache in zip(self.encoders, cache.lower):
            x, new = layer(x, positions, None, layer_cache)
            lower.append(new)

        up = self.up_layer
        h = torch.cat([cache.upsample, x.transpose(1, 2).repeat_interleave(up.stride, dim=2)], dim=2)
        new_upsample = h[:, :, -up.context:]
        x = self.up_embed(up.conv(h).transpose(1, 2))
        positions = self._positions(cache.upper.shape[3] + x.shape[1], x.shape[1], x)
        upper = []
        for layer, layer_cache in zip(self.up_encoders, cache.upper):
            x, new = layer(x, positions, None, layer_cache)
            upper.append(new)
        return self.after_norm(x), EncoderCache(new_lookahead, new_upsample, torch.stack(lower), torch.stack(upper))
