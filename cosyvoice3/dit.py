"""The CosyVoice3 flow's DiT velocity estimator: x, mu, speaker and prompt condition -> velocity.

Keys follow the released flow.pt (`decoder.estimator.transformer_blocks.N.attn.to_q`, `...attn_norm.linear`,
`...ff.ff.0.0`, `input_embed.conv_pos_embed.conv1.0`, `rotary_embed.inv_freq`, ...).

Per call: a sinusoidal timestep embedding ([sin || cos] of 1000 t) through an MLP conditions every block;
the frames' [x, cond, mu, speaker] are projected to the model width and a causal grouped-conv position
embedding is added; `depth` adaLN-Zero blocks (attention, then a tanh-GELU feed-forward, each residual and gated)
and a final adaLN + linear produce the velocity.

Two details of the reference that matter for exact results:
- rotary position embedding is applied to the projected queries and keys *before* they are split into heads,
  with a rotary width of one head, so only the first head's channels are rotated (adjacent channel pairs,
  angle = position x inv_freq); the other heads see no positional rotation at all;
- streaming calls use a static chunk mask: frame i sees frame j iff j < (i // chunk + 1) * chunk, chunks counted
  from the first (prompt) frame; offline calls see every valid frame.

`forward_rows` runs the same network over the frames [start, T) of several calls (rows, right-padded) whose
earlier frames' attention keys/values (per block) are given: with the chunk mask, frames in complete chunks never
see later frames, so a stream can keep their keys/values instead of recomputing them (`cosyvoice3.token2wav`);
a row without earlier frames is a whole call (chunk mask or full attention, as its mask says).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.flow.masks import chunk_visibility

from .config import DiTConfig

_NORM_EPS = 1e-6
_TIME_SCALE = 1000.0
_MAX_PERIOD = 10000.0
_ROTARY_BASE = 10000.0


class SinusoidalTimeEmbedding(nn.Module):
    """t -> [sin || cos] of 1000 t at frequencies exp(-ln(10000) i / (half - 1)) -> Linear, SiLU, Linear."""

    def __init__(self, dim: int, frequency_size: int) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.time_mlp = nn.Sequential(nn.Linear(frequency_size, dim), nn.SiLU(), nn.Linear(dim, dim))

    def features(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        step = math.log(_MAX_PERIOD) / (half - 1)
        # the reference's evaluation order (float32 frequencies, then scale x t x frequency), for equal rounding
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        angles = _TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(self.features(t))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convs (kernel k, left-padded k - 1) each followed by Mish, over (B, T, C) input."""

    def __init__(self, dim: int, kernel: int, groups: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    @property
    def receptive_field(self) -> int:
        """Input frames before a frame that reach it (both convs)."""
        return 2 * (self.kernel - 1)

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """valid (B, T, 1), 1 where a frame exists and 0 on a row's left padding: both convs then read zeros
        there, exactly the zero padding an unpadded row's convs read before its first frame."""
        if valid is not None:
            x = x * valid
        h = self.conv1(F.pad(x.transpose(1, 2), (self.kernel - 1, 0)))
        if valid is not None:
            h = h * valid.transpose(1, 2)
        h = self.conv2(F.pad(h, (self.kernel - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.in_channels, config.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(config.dim, config.conv_pos_kernel, config.conv_pos_groups)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x, cond, mu (B, T, 80), spks (B, 80), valid (B, T, 1) or None (see the conv) -> (B, T, dim)."""
        h = self.proj(torch.cat([x, cond, mu, spks.unsqueeze(1).expand(-1, x.shape[1], -1)], dim=-1))
        return self.conv_pos_embed(h, valid) + h


class RotaryEmbedding(nn.Module):
    """Rotary angles position x inv_freq; `inv_freq` is a stored (persistent) buffer of the released file."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (_ROTARY_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head)))

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (T,) or (B, T) -> (T or B, T, dim_head / 2) float32."""
        return positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq


def rotate_leading(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the leading 2 x angles.shape[-1] channels of x (B, T, C) in adjacent pairs; the rest pass through."""
    width = 2 * angles.shape[-1]
    head, rest = x[..., :width].float(), x[..., width:]
    even, odd = head.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.dim_head).transpose(1, 2)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, visible: Optional[torch.Tensor],
                past: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, dim); angles (T or B, T, dim_head/2) at the frames' absolute positions; visible (B, 1, T, T_past + T)
        bool or None (all); past: keys and values (B, H, T_past, dim_head) of earlier frames.
        Returns the output and this call's (keys, values), each (B, H, T, dim_head)."""
        q = self._heads(rotate_leading(self.to_q(x), angles))
        k = self._heads(rotate_leading(self.to_k(x), angles))
        v = self._heads(self.to_v(x))
        own = (k, v)
        if past is not None and past[0].shape[2] > 0:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.to_out[0](out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)), own


class AdaLayerNorm(nn.Module):
    """SiLU -> Linear(dim, n x dim) on the time embedding; affine-free LayerNorm of x modulated by it."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, n * dim)
        self.dim = dim

    def params(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(t)).unsqueeze(1).chunk(self.linear.out_features // self.dim, dim=-1)

    def norm(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), eps=_NORM_EPS) * (1 + scale) + shift


class FeedForward(nn.Module):
    """Keys `ff.0.0` and `ff.2` (Linear, tanh-GELU, dropout, Linear)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.ff = nn.ModuleDict({"0": nn.ModuleList([nn.Linear(dim, inner)]), "2": nn.Linear(inner, dim)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff["2"](F.gelu(self.ff["0"][0](x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNorm(config.dim, 6)
        self.attn = Attention(config.dim, config.heads, config.dim_head)
        self.ff = FeedForward(config.dim, config.ff_inner)

    def forward(self, x: torch.Tensor, t: torch.Tensor, angles: torch.Tensor, visible: Optional[torch.Tensor],
                past: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm.params(t)
        attended, kv = self.attn(self.attn_norm.norm(x, shift_msa, scale_msa), angles, visible, past)
        x = x + gate_msa * attended
        x = x + gate_mlp * self.ff(self.attn_norm.norm(x, shift_mlp, scale_mlp))
        return x, kv


class DiT(nn.Module):
    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        self.time_embed = SinusoidalTimeEmbedding(config.dim, config.frequency_embedding_size)
        self.input_embed = InputEmbedding(config)
        self.rotary_embed = RotaryEmbedding(config.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.norm_out = AdaLayerNorm(config.dim, 2)
        self.proj_out = nn.Linear(config.dim, config.mel_dim)

    # ---- masks ----------------------------------------------------------------------------------------
    def attention_bias(self, mask: torch.Tensor, streaming: bool) -> torch.Tensor:
        """mask (B, 1, T) -> visibility (B, 1, T, T) bool: valid keys, and with `streaming` the static chunk mask.
        (Named like the UNet estimator's hook so the shared CFM sampler drives either.)"""
        visible = mask.bool().expand(-1, mask.shape[-1], -1)
        if streaming:
            visible = visible & chunk_visibility(mask.shape[-1], self.config.static_chunk_size, mask.device)
        return visible.unsqueeze(1)

    # ---- forward --------------------------------------------------------------------------------------
    def _output(self, h: torch.Tensor, t_emb: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        scale, shift = self.norm_out.params(t_emb)  # the final modulation's order: scale first, then shift
        out = self.proj_out(self.norm_out.norm(h, shift, scale)).transpose(1, 2)
        return out if mask is None else out * mask

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80); visible from `attention_bias`
        -> velocity (B, 80, T) (zero on masked frames)."""
        t_emb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        angles = self.rotary_embed.angles(torch.arange(h.shape[1], device=h.device))
        for block in self.transformer_blocks:
            h, _ = block(h, t_emb, angles, visible)
        return self._output(h, t_emb, mask)

    def forward_rows(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                     cond: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                     past: list[Optional[tuple[torch.Tensor, torch.Tensor]]],
                     keys_values: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New frames of several rows (each its own call) over their earlier frames' keys/values; static shapes
        and no host syncs (what a CUDA graph per shape bucket can capture).

        x, mu, cond (B, 80, R + N): per row, up to R frames of left context (the earlier frames the conv position
        embedding reads; a row with fewer is left-padded, `valid` (B, R + N, 1) zero there) then its new frames,
        right-padded to N. positions (B, N): the new frames' absolute positions (rotary angles). visible
        (B, 1, N, P + N): which of the past keys (P, per row right-padded) and new keys each new frame sees.
        past: per block, keys and values (B, H, P, dim_head), or None when P = 0.
        Returns the velocity of the N new frames (B, 80, N) and their keys/values (depth, 2, B, H, N, dim_head): per
        block its keys then its values, written into `keys_values` when given (a graph's shared output buffer).
        Each block's keys and values are copied out as soon as it has run, so they are not all alive at once."""
        context = x.shape[2] - positions.shape[1]
        t_emb = self.time_embed(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, valid)[:, context:]
        angles = self.rotary_embed.angles(positions)
        if keys_values is None:
            keys_values = h.new_empty(len(self.transformer_blocks), 2, h.shape[0], self.config.heads, h.shape[1],
                                      self.config.dim_head)
        for index, (block, kv) in enumerate(zip(self.transformer_blocks, past)):
            h, (keys, values) = block(h, t_emb, angles, visible, kv)
            keys_values[index, 0].copy_(keys)
            keys_values[index, 1].copy_(values)
        return self._output(h, t_emb, None), keys_values
