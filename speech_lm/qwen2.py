"""Our own Qwen2 decoder body (inference only): RMSNorm, rotary embeddings, GQA attention via SDPA, SwiGLU MLP.

State-dict keys follow Hugging Face's ``Qwen2ForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj`` ..., ``model.norm``, ``lm_head``) so the checkpoint loads without renaming,
although q|k|v and gate|up are stored fused, one Linear each (``MergedKeys`` maps the keys).

Attention over a ``StaticKVCache`` (gpt-fast style preallocated ``[slots, kv_heads, max_len, head_dim]`` buffers per
layer) or none, in three modes:
- no cache: plain causal attention over the given sequences (teacher forcing, parity checks);
- prefill (cache + ``slots``): the same causal attention over whole sequences starting at position 0, and the
  keys/values are written to the given cache rows. Rows may be right-padded to a common length: causal attention
  never lets a real token see the padding after it, and the padding's cache entries lie beyond the sequence, where
  decode steps overwrite them before any query can see them;
- decode (cache, no ``slots``): batch row ``b`` is cache row ``b``; new keys and values are scattered at their
  absolute positions and every query attends to the buffer under the mask ``key_position <= query_position``.
  Shapes depend only on (batch, new tokens, kv_len), never on the data, so a one-token decode step over all slots
  is CUDA-graph capturable (no ``.item()``, no data-dependent shapes).

A decode step is launch-bound (a 0.5B model reads its weights in ~0.17 ms on an H200), so the code keeps the
kernel count per layer low: one GEMM for q|k|v and one for gate|up, the residual add fused into the following
RMSNorm and SiLU fused with the gate product (``speech_lm.kernels``: Triton on CUDA), rotary embedding of q and k
as one batched matmul, one scatter per cache write, and GQA attention without expanding the KV heads: the ``G`` query heads that share a KV head become
``G`` query rows of that head, so SDPA sees plain multi-head attention with a shared additive mask and can use a
fused kernel (a boolean mask with ``enable_gqa`` falls back to the math kernel on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speech_lm.kernels import add_rms_norm, silu_mul
from speech_lm.config import OutputVocabulary, Qwen2Config


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
        # One fused kernel on CUDA; it normalises in fp32 and applies the weight before rounding back (HF Qwen2
        # rounds first: at most one ulp apart in bf16, identical in fp32).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one kernel on CUDA (the residual stream's add fused in)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rotary_matrix(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """Rotate-half rotary embedding as a linear map: ``[B, T, head_dim, head_dim]`` for ``positions [B, T]``.

    ``x @ R`` equals ``x * cos + rotate_half(x) * sin`` (two non-zero products per output), so applying it is a
    single batched matmul instead of five elementwise kernels. Angles are computed in fp32.
    """
    half = head_dim // 2
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[..., None] * inv_freq  # [B, T, half]
    cos, sin = torch.diag_embed(angles.cos()), torch.diag_embed(angles.sin())
    # out[:half] = x1 cos - x2 sin ; out[half:] = x2 cos + x1 sin   (rows index the input, columns the output)
    top = torch.cat((cos, sin), dim=-1)
    bottom = torch.cat((-sin, cos), dim=-1)
    return torch.cat((top, bottom), dim=-2).to(dtype).reshape(*positions.shape, 2 * half, 2 * half)


def apply_rotary(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """x: ``[B, T, heads, head_dim]`` (may be a head slice of a wider tensor); rotary: ``[B, T, head_dim, head_dim]``
    from ``rotary_matrix``."""
    batch, length, heads, dim = x.shape
    out = torch.bmm(x.reshape(batch * length, heads, dim), rotary.reshape(batch * length, dim, dim))
    return out.view(batch, length, heads, dim)


class MergedKeys:
    """Serves several official projections as one ``nn.Linear`` whose output rows are their concatenation
    (q|k|v, gate|up): one GEMM instead of several. ``state_dict`` and ``load_state_dict`` of the owning module
    still use the official per-projection keys (``q_proj.weight`` ...), so checkpoints load unchanged.
    """

    def __init__(self, owner: nn.Module, merged: str, parts: Sequence[tuple[str, int]]) -> None:
        self.merged = merged
        self.names = [name for name, _ in parts]
        self.sizes = [size for _, size in parts]
        # partials: torch tags hooks with an attribute, which bound methods do not accept
        owner.register_state_dict_post_hook(partial(self._split))
        owner.register_load_state_dict_pre_hook(partial(self._merge))

    def _tensor_names(self, owner: nn.Module) -> list[str]:
        linear = getattr(owner, self.merged)
        return ["weight"] + (["bias"] if linear.bias is not None else [])

    def _split(self, owner: nn.Module, state: dict[str, torch.Tensor], prefix: str, _metadata: Any) -> None:
        for tensor in self._tensor_names(owner):
            merged = state.pop(f"{prefix}{self.merged}.{tensor}")
            # copies, not views of one storage: saved files then hold independent tensors (safetensors needs it)
            for name, part in zip(self.names, merged.split(self.sizes)):
                state[f"{prefix}{name}.{tensor}"] = part.clone()

    def _merge(self, owner: nn.Module, state: dict[str, torch.Tensor], prefix: str, *_args: Any) -> None:
        for tensor in self._tensor_names(owner):
            keys = [f"{prefix}{name}.{tensor}" for name in self.names]
            if all(key in state for key in keys):  # otherwise the strict load reports what is missing
                state[f"{prefix}{self.merged}.{tensor}"] = torch.cat([state.pop(key) for key in keys])


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=True)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self._keys = MergedKeys(self, "qkv_proj", [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)])

    def forward(
        self, x: torch.Tensor, plan: "AttentionPlan", cache: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """cache: this layer's whole key and value buffers, or None (see the module docstring for the modes)."""
        batch, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(batch, length, heads + 2 * kv_heads, self.head_dim)
        qk = apply_rotary(qkv[:, :, : heads + kv_heads], plan.rotary)  # q and k heads rotated by one bmm
        q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None or plan.slots is not None:
            if cache is not None:  # index_copy_: no host sync, so a prefill graph can capture it
                cache[0][:, :, :length].index_copy_(0, plan.slots, k)
                cache[1][:, :, :length].index_copy_(0, plan.slots, v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            key_cache, value_cache = (buffer[:batch, :, : plan.kv_len] for buffer in cache)
            # Scatter the new keys/values at their positions along the length axis; static shapes, no host sync.
            index = plan.positions.view(batch, 1, length, 1).expand(batch, kv_heads, length, self.head_dim)
            key_cache.scatter_(2, index, k)
            value_cache.scatter_(2, index, v)
            groups = heads // kv_heads
            # q head h uses KV head h // groups: fold each group into query rows (group-major, then time).
            q = q.reshape(batch, kv_heads, groups * length, self.head_dim)
            out = F.scaled_dot_product_attention(q, key_cache, value_cache, attn_mask=plan.mask)
            # split the rows back into (group, time) by a view (fused kernels return a transposed memory layout)
            out = out.view(batch, kv_heads, groups, length, self.head_dim).permute(0, 3, 1, 2, 4)
        return self.o_proj(out.reshape(batch, length, heads * self.head_dim))


class Qwen2MLP(nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self._keys = MergedKeys(self, "gate_up_proj", [("gate_proj", size), ("up_proj", size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


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
        residual: torch.Tensor | None,
        plan: "AttentionPlan",
        cache: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``: the caller adds the two (the next layer's fused norm does).

        x: the previous layer's MLP output, or the embeddings for the first layer (``residual`` None).
        """
        if residual is None:
            residual, hidden = x, self.input_layernorm(x)
        else:
            hidden, residual = self.input_layernorm.add_forward(x, residual)
        attention = self.self_attn(hidden, plan, cache)
        hidden, residual = self.post_attention_layernorm.add_forward(attention, residual)
        return self.mlp(hidden), residual


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer's attention shares in one forward (built once by ``Qwen2Model``)."""

    rotary: torch.Tensor  # [B, T, head_dim, head_dim], see rotary_matrix
    positions: torch.Tensor  # [B, T]
    slots: torch.Tensor | None = None  # prefill: the cache rows that receive the keys/values
    kv_len: int = 0  # decode: cache positions attended to
    mask: torch.Tensor | None = None  # decode: additive mask over those positions


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
        slots: Sequence[int] | torch.Tensor | None = None,
        kv_len: int | None = None,
    ) -> torch.Tensor:
        """Last hidden state after the final norm, ``[B, T, hidden]``.

        inputs_embeds: ``[B, T, hidden]``. positions: ``[B, T]`` absolute positions (default ``0..T-1``; the
        modes without a cache or with ``slots`` treat each row as a whole sequence from position 0).
        cache + slots: prefill; row ``b`` goes to cache row ``slots[b]``. cache alone: a decode step over cache
        rows ``0..B-1``, attending to the first ``kv_len`` cache positions only (default: all; every position must
        be below it; attention cost scales with it, so callers pass a bucket just above their longest sequence).
        """
        batch, length, _ = inputs_embeds.shape
        device = inputs_embeds.device
        if positions is None:
            positions = torch.arange(length, device=device).expand(batch, length)
        rotary = rotary_matrix(positions, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype)
        if cache is None:
            plan = AttentionPlan(rotary, positions)
        elif slots is not None:
            plan = AttentionPlan(rotary, positions, slots=torch.as_tensor(slots, device=device))
        else:
            kv_len = kv_len or cache.max_len
            plan = AttentionPlan(rotary, positions, kv_len=kv_len,
                                 mask=self._cache_mask(positions, kv_len, inputs_embeds.dtype))
        x, residual = inputs_embeds, None
        for index, layer in enumerate(self.layers):
            layer_cache = (cache.keys[index], cache.values[index]) if cache is not None else None
            x, residual = layer(x, residual, plan, layer_cache)
        return self.norm.add_forward(x, residual)[0]

    def _cache_mask(self, positions: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, G*T, max_len]`` (0 where ``key_position <= query_position``, else -inf) for the
        grouped query rows of ``Qwen2Attention``; built once per forward and shared by all layers."""
        batch, length = positions.shape
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        key_positions = torch.arange(max_len, device=positions.device)
        visible = key_positions.view(1, 1, -1) <= positions.view(batch, length, 1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(~visible, float("-inf"))
        if length == 1:
            return mask.view(batch, 1, 1, max_len)  # broadcasts over the group rows
        return mask.unsqueeze(1).expand(batch, groups, length, max_len).reshape(batch, 1, groups * length, max_len)


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 body plus the (tied) text ``lm_head``: Spark-TTS samples from it; the CosyVoice models never compute
    text logits, there the head exists so that the checkpoint's ``lm_head.weight`` key loads (it shares storage
    with ``embed_tokens.weight``)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


class SpeechLM(nn.Module):
    """What every speech LM on the batched decoder (``speech_lm.decode``) provides: a Qwen2 `body` (a
    `Qwen2Model`) whose last hidden state an output head turns into the sampling distribution. Subclasses provide
    `body`, `llm_decoder` (the head; its weight sets the cache's device and dtype), `config.qwen`, and:

    - ``embed_prefix(prefix) -> [1, len(prefix), hidden]``: the input embeddings of a prefix that the model's own
      package built (its ids layout: special rows, text ids, prompt tokens ...);
    - ``embed_speech(tokens [B, T]) -> [B, T, hidden]``: how a generated token is fed back;
    - ``log_probs(hidden) -> [..., vocabulary.size]`` in fp32: the distribution the decoder samples from (a model
      that samples at another temperature or cuts the tail applies that here);
    - ``vocabulary``: the size of that distribution and the stop ids (default: ``config.vocabulary``).
    """

    config: Any
    body: Qwen2Model
    llm_decoder: nn.Linear

    def embed_prefix(self, prefix: Any) -> torch.Tensor:
        raise NotImplementedError

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def vocabulary(self) -> OutputVocabulary:
        return self.config.vocabulary

    def hidden(self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None = None,
               cache: StaticKVCache | None = None, slots: Sequence[int] | torch.Tensor | None = None,
               kv_len: int | None = None) -> torch.Tensor:
        """Last hidden state after the final norm (see ``Qwen2Model.forward`` for the cache arguments)."""
        return self.body(inputs_embeds, positions, cache, slots, kv_len)

    def forward(self, inputs_embeds: torch.Tensor, *cache_args: Any, **cache_kwargs: Any) -> torch.Tensor:
        """``log_probs`` of ``hidden`` (same arguments)."""
        return self.log_probs(self.hidden(inputs_embeds, *cache_args, **cache_kwargs))

    def new_cache(self, num_slots: int, max_len: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> StaticKVCache:
        weight = self.llm_decoder.weight
        return StaticKVCache(self.config.qwen, num_slots, max_len, device or weight.device, dtype or weight.dtype)
