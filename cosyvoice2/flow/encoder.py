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


def relative_position_table(length: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """ESPnet relative encodings for distances length-1 .. -(length-1), shape (1, 2*length-1, dim).

    Computed in float32 the way upstream builds its table, so the values match it bit for bit.
    """
    distance = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device).unsqueeze(1)
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim)
    )
    angle = distance * inv_freq
    table = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).flatten(1)  # even sin, odd cos
    return table.unsqueeze(0).to(dtype)


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


class RelPositionSelfAttention(nn.Module):
    """Transformer-XL style self-attention with learned u/v biases (ESPnet `rel_selfattn`)."""

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

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim)

    @staticmethod
    def _by_distance(scores: torch.Tensor) -> torch.Tensor:
        """(.., T, 2T-1) scores per table row -> (.., T, T) where [i, j] is the row for distance i - j."""
        length = scores.size(-2)
        steps = torch.arange(length, device=scores.device)
        column = (length - 1) - steps.unsqueeze(1) + steps.unsqueeze(0)
        return scores.gather(-1, column.expand(*scores.shape[:-2], length, length))

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, visible: Optional[torch.Tensor]) -> torch.Tensor:
        batch, length, width = x.shape
        q = self._split_heads(self.linear_q(x))  # (B, T, H, D)
        k = self._split_heads(self.linear_k(x)).transpose(1, 2)
        v = self._split_heads(self.linear_v(x)).transpose(1, 2)
        p = self._split_heads(self.linear_pos(pos_table)).transpose(1, 2)  # (1, H, 2T-1, D)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = self._by_distance(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (content + position) / math.sqrt(self.head_dim)
        if visible is None:
            weights = torch.softmax(scores, dim=-1)
        else:
            hidden = ~visible
            weights = torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1).masked_fill(hidden, 0.0)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(batch, length, width)
        return self.linear_out(out)


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
        self.self_attn = RelPositionSelfAttention(width, heads)
        self.feed_forward = PositionwiseFeedForward(width, hidden)
        self.norm_ff = nn.LayerNorm(width, eps=_LAYER_LN_EPS)
        self.norm_mha = nn.LayerNorm(width, eps=_LAYER_LN_EPS)

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, visible: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos_table, visible)
        return x + self.feed_forward(self.norm_ff(x))


class PreLookaheadLayer(nn.Module):
    """Residual conv pair giving every frame `lookahead` frames of right context (zeros at the end of input)."""

    def __init__(self, width: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(width, width, lookahead + 1)
        self.conv2 = nn.Conv1d(width, width, 3)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.repeat_interleave(self.stride, dim=2)
        return self.conv(F.pad(h, (2 * self.stride, 0)))


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
            x = layer(x, pos_table, visible)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        length = x.size(1)
        x = self.up_embed(x)
        pos_table = relative_position_table(length, cfg.width, x.device, x.dtype)
        up_lengths = None if lengths is None else lengths * cfg.upsample_stride
        visible = self._visibility(length, cfg.static_chunk_size * cfg.upsample_stride, streaming, up_lengths,
                                   x.device)
        for layer in self.up_encoders:
            x = layer(x, pos_table, visible)
        return self.after_norm(x)
