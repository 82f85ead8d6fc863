"""The semantic stream of BiCodec: feature encoder, factorized VQ, and the prenet/postnet feature decoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spark_tts.codec.layers import SamplingBlock, VocosBackbone
from spark_tts.config import EncoderParams, FeatDecoderParams, QuantizerParams


class _ResampleStage(nn.Sequential):
    """``downsample.N``: a sampling block (index 0) then a 2-layer unconditioned ConvNeXt stack (index 1)."""

    def __init__(self, dim: int, intermediate_dim: int, up: int = 1, down: int = 1) -> None:
        super().__init__(SamplingBlock(dim, upsample_scale=up, downsample_scale=down),
                         VocosBackbone(dim, dim, intermediate_dim, num_layers=2))

    def run(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """channel-last in and out."""
        sampler, backbone = self[0], self[1]
        if mask is not None and not sampler.identity_rate:
            raise NotImplementedError("masked batches need sample ratio 1 (the released configuration)")
        return backbone(sampler(x), mask=mask)


class FeatureEncoder(nn.Module):
    """wav2vec2 features ``[B, input_channels, T]`` -> latent ``[B, out_channels, T']`` (T' = T at ratio 1)."""

    def __init__(self, p: EncoderParams) -> None:
        super().__init__()
        self.encoder = VocosBackbone(p.input_channels, p.vocos_dim, p.vocos_intermediate_dim, p.vocos_num_layers)
        self.downsample = nn.Sequential(
            *(_ResampleStage(p.vocos_dim, p.vocos_intermediate_dim, down=r) for r in p.sample_ratios)
        )
        self.project = nn.Linear(p.vocos_dim, p.out_channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.encoder(x, mask=mask)
        for stage in self.downsample:
            x = stage.run(x, mask)
        return self.project(x).transpose(1, 2)


class FeatureDecoder(nn.Module):
    """Prenet/postnet: ``[B, input_channels, T]`` (+ optional condition ``[B, condition_dim]``) ->
    ``[B, out_channels, T'']``."""

    def __init__(self, p: FeatDecoderParams) -> None:
        super().__init__()
        self.linear_pre = nn.Linear(p.input_channels, p.vocos_dim)
        self.downsample = nn.Sequential(
            *(_ResampleStage(p.vocos_dim, p.vocos_intermediate_dim, up=r) for r in p.sample_ratios)
        )
        self.vocos_backbone = VocosBackbone(p.vocos_dim, p.vocos_dim, p.vocos_intermediate_dim,
                                            p.vocos_num_layers, condition_dim=p.condition_dim)
        self.linear = nn.Linear(p.vocos_dim, p.out_channels)
        self.use_tanh_at_final = p.use_tanh_at_final

    def forward(self, x: torch.Tensor, condition: torch.Tensor | None = None, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.linear_pre(x.transpose(1, 2))
        for stage in self.downsample:
            x = stage.run(x, mask)
        x = self.linear(self.vocos_backbone(x.transpose(1, 2), condition=condition, mask=mask)).transpose(1, 2)
        return torch.tanh(x) if self.use_tanh_at_final else x


class FactorizedVQ(nn.Module):
    """Semantic codebook: a 1x1 conv to ``codebook_dim``, nearest code by cosine similarity, and back.

    ``in_project``/``out_project`` are weight-normed in the checkpoint and folded at load.
    ``cluster_size`` is a training statistic kept only so that the checkpoint loads strictly.
    """

    def __init__(self, p: QuantizerParams) -> None:
        super().__init__()
        self.in_project = nn.Conv1d(p.input_dim, p.codebook_dim, kernel_size=1)
        self.out_project = nn.Conv1d(p.codebook_dim, p.input_dim, kernel_size=1)
        self.codebook = nn.Embedding(p.codebook_size, p.codebook_dim)
        self.register_buffer("cluster_size", torch.zeros(p.codebook_size))

    def scores(self, z: torch.Tensor) -> torch.Tensor:
        """``[B, T, codebook_size]``: minus the squared distance between L2-normalised latent and code
        (the largest score is the nearest code, i.e. the highest cosine similarity)."""
        latent = F.normalize(self.in_project(z).transpose(1, 2), dim=-1)
        codes = F.normalize(self.codebook.weight, dim=-1)
        return -(latent.pow(2).sum(-1, keepdim=True) - 2 * latent @ codes.t() + codes.pow(2).sum(-1))

    def tokenize(self, z: torch.Tensor) -> torch.Tensor:
        """latent ``[B, input_dim, T]`` -> token ids ``[B, T]`` (int64)."""
        return self.scores(z).argmax(dim=-1)

    def detokenize(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` ids -> ``[B, input_dim, T]`` (raw codebook rows, not normalised, projected back)."""
        return self.out_project(self.codebook(tokens).transpose(1, 2))
