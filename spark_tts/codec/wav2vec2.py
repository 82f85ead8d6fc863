"""Our wav2vec2 (stable-layer-norm variant, as wav2vec2-large-xlsr-53) for BiCodec's semantic features.

Only what Spark needs: the conv front end, the feature projection, the positional conv and the first
``MIXED_LAYERS[-1]`` (16) transformer layers. Spark's feature is the mean of the raw outputs of layers 11, 14 and
16 (1-based), so layers 17-24 and the final LayerNorm of the released 24-layer model never affect it and are not
built (the strict loader still checks that the file holds them).

Batching: sequences of different lengths are right-padded and carry a frame mask. Padded frames are zeroed before
the positional conv and masked out of attention as keys, and the conv front end only produces a sequence's frames
from its own samples, so a sequence's real frames equal its solo result (unlike the upstream runtime, which pads
without a mask). Module and parameter names follow the released ``wav2vec2.*`` keys with the prefix removed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spark_tts.config import Wav2Vec2Params

MIXED_LAYERS = (11, 14, 16)
NORMALIZE_EPS = 1e-7


def normalize_waveform(wav: torch.Tensor) -> torch.Tensor:
    """Zero mean, unit variance over the given samples (population variance, +1e-7): the model's input
    convention (``Wav2Vec2FeatureExtractor(do_normalize=True)``)."""
    wav = wav.float()
    return (wav - wav.mean()) / torch.sqrt(wav.var(unbiased=False) + NORMALIZE_EPS)


class _ConvLayer(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, bias: bool, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, bias=bias)
        self.layer_norm = nn.LayerNorm(cout, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.layer_norm(self.conv(x).transpose(1, 2)).transpose(1, 2))


class _FeatureExtractor(nn.Module):
    def __init__(self, p: Wav2Vec2Params) -> None:
        super().__init__()
        dims = (1, *p.conv_dim)
        self.conv_layers = nn.ModuleList(
            _ConvLayer(dims[i], dims[i + 1], k, s, p.conv_bias, p.layer_norm_eps)
            for i, (k, s) in enumerate(zip(p.conv_kernel, p.conv_stride))
        )

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = wav.unsqueeze(1)
        for layer in self.conv_layers:
            x = layer(x)
        return x  # [B, C, frames]


class _FeatureProjection(nn.Module):
    def __init__(self, p: Wav2Vec2Params) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(p.conv_dim[-1], eps=p.layer_norm_eps)
        self.projection = nn.Linear(p.conv_dim[-1], p.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.layer_norm(x))


class _PositionalConv(nn.Module):
    """Grouped conv over time (weight-normed over the kernel axis in the file, folded at load), the last
    output frame dropped for an even kernel, GELU."""

    def __init__(self, p: Wav2Vec2Params) -> None:
        super().__init__()
        k = p.num_conv_pos_embeddings
        self.conv = nn.Conv1d(p.hidden_size, p.hidden_size, k, padding=k // 2, groups=p.num_conv_pos_embedding_groups)
        self.trim = 1 if k % 2 == 0 else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C]`` -> ``[B, T, C]``."""
        y = self.conv(x.transpose(1, 2))
        if self.trim:
            y = y[..., : -self.trim]
        return F.gelu(y).transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self, p: Wav2Vec2Params) -> None:
        super().__init__()
        self.heads = p.num_attention_heads
        self.q_proj = nn.Linear(p.hidden_size, p.hidden_size)
        self.k_proj = nn.Linear(p.hidden_size, p.hidden_size)
        self.v_proj = nn.Linear(p.hidden_size, p.hidden_size)
        self.out_proj = nn.Linear(p.hidden_size, p.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (proj(x).view(batch, length, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class _FeedForward(nn.Module):
    def __init__(self, p: Wav2Vec2Params) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(p.hidden_size, p.intermediate_size)
        self.output_dense = nn.Linear(p.intermediate_size, p.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class _EncoderLayer(nn.Module):
    """Pre-norm transformer layer (stable layer norm)."""

    def __init__(self, p: Wav2Vec2Params) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)
        self.attention = _Attention(p)
        self.final_layer_norm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)
        self.feed_forward = _FeedForward(p)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.layer_norm(x), key_mask)
        return x + self.feed_forward(self.final_layer_norm(x))


class _Encoder(nn.Module):
    def __init__(self, p: Wav2Vec2Params, num_layers: int) -> None:
        super().__init__()
        self.pos_conv_embed = _PositionalConv(p)
        self.layers = nn.ModuleList(_EncoderLayer(p) for _ in range(num_layers))


class Wav2Vec2Features(nn.Module):
    """Normalised waveforms -> Spark's mixed wav2vec2 features ``[B, frames, hidden]``."""

    def __init__(self, p: Wav2Vec2Params | None = None) -> None:
        super().__init__()
        self.params = p = p or Wav2Vec2Params()
        if p.num_hidden_layers < MIXED_LAYERS[-1]:
            raise ValueError(f"wav2vec2 needs at least {MIXED_LAYERS[-1]} layers, config has {p.num_hidden_layers}")
        self.feature_extractor = _FeatureExtractor(p)
        self.feature_projection = _FeatureProjection(p)
        self.encoder = _Encoder(p, MIXED_LAYERS[-1])

    def hidden_states(self, wav: torch.Tensor, frame_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``[input of layer 1, output of layer 1, ..., output of layer 16]`` (each ``[B, T, hidden]``).

        wav: ``[B, samples]`` normalised (padding zero); frame_mask: ``[B, T]`` bool (True = real frame) or None.
        """
        x = self.feature_projection(self.feature_extractor(wav).transpose(1, 2))
        key_mask = None
        if frame_mask is not None:
            x = x * frame_mask.unsqueeze(-1).to(x.dtype)
            key_mask = frame_mask[:, None, None, :]  # [B, 1, 1, T]: padded frames are no key
        x = x + self.encoder.pos_conv_embed(x)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
            states.append(x)
        return states

    def forward(self, wav: torch.Tensor, frame_mask: torch.Tensor | None = None) -> torch.Tensor:
        states = self.hidden_states(wav, frame_mask)
        return sum(states[i] for i in MIXED_LAYERS) / len(MIXED_LAYERS)
