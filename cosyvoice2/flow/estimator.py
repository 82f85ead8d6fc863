"""Velocity estimator of the CFM: a causal, single-level, Matcha-style 1-D UNet
(docs/reference/cosyvoice2.md#estimator).

Key layout follows upstream flow.pt under `decoder.estimator.` (stages `<name>.N.{0,1,2}`, diffusers-style
`attn1.to_q` / `ff.net.0.proj` names). Only one channel level is supported (released and micro models): the
stage after the down and up blocks is then a causal conv, and there is no temporal resampling.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn

from .config import EstimatorConfig
from .masks import chunk_visibility

_LN_EPS = 1e-5
_MASKED_BIAS = -1.0e10


class CausalConv1d(nn.Conv1d):
    """Conv1d that left-pads kernel_size-1 zeros, so output t depends on inputs <= t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class _SwapTimeChannels(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """Causal conv -> LayerNorm over channels -> Mish, masked in and out (keys `block.0`, `block.2`)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3),
            _SwapTimeChannels(),
            nn.LayerNorm(dim_out, eps=_LN_EPS),
            _SwapTimeChannels(),
            nn.Mish(),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask


class CausalResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_embed_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_embed_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(temb).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


class SelfAttention(nn.Module):
    """diffusers `Attention` as used here: bias-free q/k/v, scale 1/sqrt(head_dim), additive mask bias."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # upstream's index 1 is a parameter-free dropout

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self._split_heads(self.to_q(x)), self._split_heads(self.to_k(x)), self._split_heads(self.to_v(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out[0](out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class GELUProjection(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))  # exact (erf) GELU


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        # net.1 is upstream's dropout; an Identity keeps `net.2` at its index
        self.net = nn.Sequential(GELUProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Self-attention + feed-forward, pre-LayerNorm (`norm1`, `norm3`; no cross-attention)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


class UNetStage(nn.ModuleList):
    """[resnet, transformer blocks(, causal conv)] -- upstream's `<stage>.{0,1,2}` key layout."""

    def __init__(self, dim_in: int, config: EstimatorConfig, with_conv: bool) -> None:
        dim = config.channels
        modules: list[nn.Module] = [
            CausalResnetBlock1D(dim_in, dim, config.time_embed_dim),
            nn.ModuleList(
                TransformerBlock(dim, config.num_heads, config.attention_head_dim) for _ in range(config.n_blocks)
            ),
        ]
        if with_conv:
            modules.append(CausalConv1d(dim, dim, 3))
        super().__init__(modules)

    def features(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Resnet then transformer blocks, (B, C_in, T) -> (B, C, T); the causal conv is applied by the caller."""
        h = self[0](x, mask, temb).transpose(1, 2)
        for block in self[1]:
            h = block(h, bias)
        return h.transpose(1, 2)

    def conv(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self[2](x * mask)


class SinusoidalTimeEmbedding(nn.Module):
    """[sin ‖ cos](1000 t * 10000^(-k/(half-1))), concatenated halves."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        arg = 1000 * t.unsqueeze(1) * freq.unsqueeze(0)
        return torch.cat([arg.sin(), arg.cos()], dim=-1)


class TimestepMLP(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalUNetEstimator(nn.Module):
    def __init__(self, config: EstimatorConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.channels
        self.time_embeddings = SinusoidalTimeEmbedding(config.in_channels)
        self.time_mlp = TimestepMLP(config.in_channels, config.time_embed_dim)
        self.down_blocks = nn.ModuleList([UNetStage(config.in_channels, config, with_conv=True)])
        self.mid_blocks = nn.ModuleList(UNetStage(dim, config, with_conv=False) for _ in range(config.num_mid_blocks))
        self.up_blocks = nn.ModuleList([UNetStage(2 * dim, config, with_conv=True)])
        self.final_block = CausalBlock1D(dim, dim)
        self.final_proj = nn.Conv1d(dim, config.out_channels, 1)

    def attention_bias(self, mask: torch.Tensor, streaming: bool) -> torch.Tensor:
        """mask (B, 1, T) -> additive bias (B, 1, T, T): 0 where visible, -1e10 where not.

        Streaming adds the static chunk mask. Depends only on T, so the CFM computes it once per call.
        """
        visible = mask.bool().expand(-1, mask.size(-1), -1)
        if streaming:
            visible = visible & chunk_visibility(mask.size(-1), self.config.static_chunk_size, mask.device)
        return ((1.0 - visible.to(mask.dtype)) * _MASKED_BIAS).unsqueeze(1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80); bias from attention_bias -> (B, 80, T)."""
        temb = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)

        down = self.down_blocks[0]
        skip = down.features(h, mask, temb, bias)
        h = down.conv(skip, mask)
        for stage in self.mid_blocks:
            h = stage.features(h, mask, temb, bias)
        up = self.up_blocks[0]
        h = up.features(torch.cat([h, skip], dim=1), mask, temb, bias)
        h = up.conv(h, mask)

        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask
