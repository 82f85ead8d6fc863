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

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..flow.encoder import (  # the UNet flow encoder's layers; the DiT encoder runs them chunk by chunk
    ConformerLayer, LinearEmbedding, PreLookaheadLayer, Upsample1D, relative_positions,
)
from .config import DiTEncoderConfig

_EMBED_LN_EPS = 1e-5
_LEAKY_SLOPE = 0.01
_LOOKAHEAD_CONV2_CONTEXT = 2  # kernel 3, left-padded by 2


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
        self.up_layer = Upsample1D(w, config.upsample_stride)
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
