"""The DiT velocity estimator (Step-Audio2 token2wav): x, mu, speaker and cond -> velocity, time-major inside.

Keys follow the released flow.pt (`decoder.estimator.blocks.N.attn.to_q`, `...conv.block.1`, ...).

Each of the `depth` blocks: adaLN-Zero modulation from the timestep embedding only (9 vectors: shift/scale/gate of
attention, MLP and conv), then attention (QK-norm, no positional encoding) -> causal conv block -> MLP, each
residual and gated. The conv block and the attention are the only parts that see other frames, so streaming
keeps, per block, the causal convs' left context and the attention keys/values (`forward_chunk`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import DiTEstimatorConfig

_ADALN_EPS = 1e-6
_AFFINE_LN_EPS = 1e-5
_TIME_SCALE = 1000.0
_MAX_PERIOD = 10000.0


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    """t in [0, 1] -> [cos || sin] of 1000 t at geometric frequencies -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden: int, frequency_size: int) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def features(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_size // 2
        # evaluated in this order (float32 exponent, then the time product) to round like the reference
        freqs = torch.exp(-math.log(_MAX_PERIOD) * torch.arange(half, device=t.device) / half).to(t)
        args = (t * _TIME_SCALE)[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.features(t))


class Attention(nn.Module):
    """q/k/v with bias -> heads -> LayerNorm over each head's q and k -> scaled dot product -> proj."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(hidden, inner)
        self.to_k = nn.Linear(hidden, inner)
        self.to_v = nn.Linear(hidden, inner)
        self.q_norm = nn.LayerNorm(head_dim, eps=_AFFINE_LN_EPS)
        self.k_norm = nn.LayerNorm(head_dim, eps=_AFFINE_LN_EPS)
        self.proj = nn.Linear(inner, hidden)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_mask: Optional[torch.Tensor], cache: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C); key_mask (B, 1, 1 or T, T + T_c) bool or None; cache (B, H, T_c, 2 D) keys || values.

        Keys are [this chunk || cache] (newest first, the reference's order; attention itself does not depend on
        the order). Returns the output and this chunk's own keys || values (B, H, T, 2 D).

        slots (B, H, T + T_c, 2 D), instead of `cache`: one buffer holding the cache behind T free frames; the
        chunk's keys || values are written into those and attention reads the whole buffer, so nothing is
        concatenated (the CUDA-graph path, whose buffers are static); the returned own keys are a view of it.
        """
        batch, length, _ = x.shape
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        own = torch.cat([k, v], dim=-1)
        if slots is not None:
            slots[:, :, :length].copy_(own)
            own = slots[:, :, :length]
            k, v = slots.split(self.head_dim, dim=-1)
        elif cache is not None and cache.shape[2] > 0:
            cached_k, cached_v = cache.split(self.head_dim, dim=-1)
            k, v = torch.cat([k, cached_k], dim=2), torch.cat([v, cached_v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.proj(out.transpose(1, 2).reshape(batch, length, -1)), own


class CausalConv1d(nn.Conv1d):
    """Conv1d over (B, C, T) whose output frame t sees input frames t - (k - 1) .. t."""

    @property
    def context(self) -> int:
        return self.kernel_size[0] - 1

    def step(self, x: torch.Tensor, cache: Optional[torch.Tensor],
             lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cache (B, C, k - 1) = the previous input frames (zeros at the start) -> output, new cache.

        lengths (B,): real frames per right-padded row (None: all); the new cache ends at each row's last real frame.
        """
        if cache is None:
            cache = x.new_zeros(x.shape[0], x.shape[1], self.context)
        x = torch.cat([cache, x], dim=2)
        if lengths is None:
            new_cache = x[:, :, x.shape[2] - self.context:]
        else:
            index = lengths[:, None] + torch.arange(self.context, device=x.device)[None, :]  # (B, context)
            new_cache = x.gather(2, index[:, None, :].expand(-1, x.shape[1], -1))
        return super().forward(x), new_cache


class CausalConvBlock(nn.Module):
    """CausalConv1d -> LayerNorm (affine) -> Mish -> CausalConv1d, time-major in and out.

    `block` indices 1, 3 and 6 hold the two convs and the norm, as in the released checkpoint (the other indices
    are parameter-free transposes and the activation there).
    """

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.block = nn.ModuleDict({"1": CausalConv1d(channels, channels, kernel),
                                    "3": nn.LayerNorm(channels, eps=_AFFINE_LN_EPS),
                                    "6": CausalConv1d(channels, channels, kernel)})
        self.channels = channels

    def forward(self, x: torch.Tensor, cache: Optional[torch.Tensor] = None,
                lengths: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C); cache (B, 2 C, k - 1) = [conv1 inputs || conv2 inputs] -> (B, T, C), new cache."""
        first_cache, second_cache = (None, None) if cache is None else cache.split(self.channels, dim=1)
        h, first_new = self.block["1"].step(x.transpose(1, 2), first_cache, lengths)
        h = F.mish(self.block["3"](h.transpose(1, 2)))
        h, second_new = self.block["6"].step(h.transpose(1, 2), second_cache, lengths)
        return h.transpose(1, 2), torch.cat([first_new, second_new], dim=1)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    def __init__(self, config: DiTEstimatorConfig) -> None:
        super().__init__()
        c = config.hidden_size
        self.attn = Attention(c, config.num_heads, config.head_dim)
        self.mlp = MLP(c, config.mlp_hidden)
        self.conv = CausalConvBlock(c, config.conv_kernel)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c, 9 * c))
        self.hidden = c

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden,), eps=_ADALN_EPS)  # norm1/2/3: affine-free

    def forward(self, x: torch.Tensor, c: torch.Tensor, key_mask: Optional[torch.Tensor],
                conv_cache: Optional[torch.Tensor] = None, kv_cache: Optional[torch.Tensor] = None,
                lengths: Optional[torch.Tensor] = None,
                kv_slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C), c (B, 1, C) -> x, new conv cache, this chunk's keys/values (`Attention`: kv_slots)."""
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        attended, kv = self.attn(modulate(self._norm(x), shift_msa, scale_msa), key_mask, kv_cache, kv_slots)
        x = x + gate_msa * attended
        convolved, conv = self.conv(modulate(self._norm(x), shift_conv, scale_conv), conv_cache, lengths)
        x = x + gate_conv * convolved
        x = x + gate_mlp * self.mlp(modulate(self._norm(x), shift_mlp, scale_mlp))
        return x, conv, kv


class FinalLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.linear = nn.Linear(hidden, out_channels)
        self.hidden = hidden

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(F.layer_norm(x, (self.hidden,), eps=_ADALN_EPS), shift, scale))


class DiT(nn.Module):
    def __init__(self, config: DiTEstimatorConfig) -> None:
        super().__init__()
        self.config = config
        self.t_embedder = TimestepEmbedder(config.hidden_size, config.frequency_embedding_size)
        self.in_proj = nn.Linear(config.in_channels, config.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.final_layer = FinalLayer(config.hidden_size, config.out_channels)

    def _inputs(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.t_embedder(t).unsqueeze(1)
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, x.shape[2]), cond], dim=1)
        return self.in_proj(h.transpose(1, 2)), c

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Offline: x, mu, cond (B, 80, T), t (B,), spks (B, 80), key_mask (B, 1, 1, T) bool -> (B, 80, T)."""
        h, c = self._inputs(x, mu, t, spks, cond)
        for block in self.blocks:
            h, _, _ = block(h, c, key_mask)
        return self.final_layer(h, c).transpose(1, 2)

    def forward_chunk(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                      cond: torch.Tensor, conv_cache: Optional[torch.Tensor], kv_cache: Optional[torch.Tensor],
                      key_mask: Optional[torch.Tensor] = None,
                      lengths: Optional[torch.Tensor] = None,
                      kv_slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chunk continuing cached state: conv_cache (depth, B, 2 C, k - 1), kv_cache (depth, B, H, T_c, 2 D)
        (None: start of a stream) -> velocity (B, 80, T), new conv cache, this chunk's keys/values
        (depth, B, H, T, 2 D).

        Rows of several streams: x, mu, cond right-padded to T with `lengths` (B,) real frames; caches padded to T_c;
        key_mask (B, 1, 1, T + T_c) marks each row's real chunk frames and real cached frames.
        kv_slots (depth, B, H, T + T_c, 2 D) instead of kv_cache: the cache behind T free frames per block, filled
        with this chunk's keys/values (`Attention`); the returned keys/values are then a view of it."""
        h, c = self._inputs(x, mu, t, spks, cond)
        convs, kvs = [], []
        for i, block in enumerate(self.blocks):
            h, conv, kv = block(h, c, key_mask, None if conv_cache is None else conv_cache[i],
                                None if kv_cache is None else kv_cache[i], lengths,
                                None if kv_slots is None else kv_slots[i])
            convs.append(conv)
            kvs.append(kv)
        own = torch.stack(kvs) if kv_slots is None else kv_slots[:, :, :, : x.shape[2]]
        return self.final_layer(h, c).transpose(1, 2), torch.stack(convs), own
