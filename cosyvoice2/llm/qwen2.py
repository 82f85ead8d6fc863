"""Our own Qwen2 decoder body (inference only): RMSNorm, rotary embeddings, GQA attention via SDPA, SwiGLU MLP.

Module and parameter names follow Hugging Face's ``Qwen2ForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj`` ..., ``model.norm``, ``lm_head``) so the checkpoint loads without renaming.

Two attention paths:
- no cache: plain causal attention over the given sequence (teacher forcing, parity checks);
- ``StaticKVCache``: gpt-fast style preallocated ``[slots, kv_heads, max_len, head_dim]`` buffers per layer. New keys
  and values are scattered at their absolute positions and every query attends to the whole buffer under the mask
  ``key_position <= query_position``. Shapes depend only on (batch, new tokens, max_len), never on the data, so a
  one-token decode step over all slots is CUDA-graph capturable (no ``.item()``, no data-dependent shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen2Config:
    """Qwen2 body hyper-parameters; defaults are CosyVoice2-0.5B's (``CosyVoice-BlankEN/config.json``)."""

    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Qwen2Config":
        """Build from an HF-style config dict (unknown fields such as ``attn_implementation`` are ignored)."""
        if values.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported (CosyVoice2 does not use it)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


class StaticKVCache:
    """Preallocated per-layer key/value buffers ``[slots, kv_heads, max_len, head_dim]``."""

    def __init__(
        self, config: Qwen2Config, num_slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        shape = (num_slots, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.num_slots = num_slots
        self.max_len = max_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the weight, as HF Qwen2 does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, T, head_dim]`` for integer ``positions [B, T]`` (computed in fp32, rotate-half layout)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [B, T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            key_cache, value_cache = cache
            # Scatter the new keys/values at (row, head, position); static shapes, no host sync.
            rows = torch.arange(batch, device=x.device).view(batch, 1, 1)
            heads = torch.arange(self.num_kv_heads, device=x.device).view(1, -1, 1)
            pos = positions.view(batch, 1, length)
            key_cache.index_put_((rows, heads, pos), k)
            value_cache.index_put_((rows, heads, pos), v)
            out = F.scaled_dot_product_attention(q, key_cache, value_cache, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out)


class Qwen2MLP(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Embedding table, decoder layers and final norm (``embed_tokens`` is used only by the caller for text ids)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: StaticKVCache | None = None,
        slot: int | None = None,
    ) -> torch.Tensor:
        """Last hidden state after the final norm, ``[B, T, hidden]``.

        inputs_embeds: ``[B, T, hidden]``. positions: ``[B, T]`` absolute positions (default ``0..T-1``).
        cache: attend through the static KV cache. ``slot`` selects one cache row for a batch of 1 (prefill);
        ``slot=None`` means the batch covers all cache rows in order (the decode step).
        """
        batch, length, _ = inputs_embeds.shape
        if positions is None:
            positions = torch.arange(length, device=inputs_embeds.device).expand(batch, length)
        cos, sin = rotary_cos_sin(
            positions, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype
        )
        mask = None
        if cache is not None:
            key_positions = torch.arange(cache.max_len, device=inputs_embeds.device)
            mask = (key_positions.view(1, 1, 1, -1) <= positions.view(batch, 1, length, 1))
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None:
                keys, values = cache.keys[index], cache.values[index]
                if slot is not None:
                    keys, values = keys[slot : slot + 1], values[slot : slot + 1]
                layer_cache = (keys, values)
            x = layer(x, cos, sin, positions, layer_cache, mask)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 body plus the (tied) text ``lm_head``. CosyVoice never computes text logits; the head exists so that
    the checkpoint's ``lm_head.weight`` key loads (it shares storage with ``embed_tokens.weight``)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
