"""CausalFlow: speech tokens (+ prompt tokens/mel, x-vector) -> mel for the new tokens (spec §3.3)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .cfm import CausalCFM
from .config import FlowConfig
from .encoder import UpsampleConformerEncoder
from .estimator import CausalUNetEstimator


class CausalFlow(nn.Module):
    """State-dict keys equal upstream flow.pt (CausalMaskedDiffWithXvec).

    Batches must hold sequences of one length (no padding masks); batch 1 reproduces upstream exactly.
    """

    def __init__(self, config: FlowConfig = FlowConfig(), noise: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.config = config
        width = config.encoder.width
        self.input_embedding = nn.Embedding(config.vocab_size, width)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.encoder = UpsampleConformerEncoder(config.encoder)
        self.encoder_proj = nn.Linear(width, config.output_size)
        self.decoder = CausalCFM(CausalUNetEstimator(config.estimator), config.cfm, noise)

    def encode(
        self, token: torch.Tensor, prompt_token: torch.Tensor, streaming: bool, finalize: bool
    ) -> torch.Tensor:
        """mu (B, 80, 2*T) over prompt + tokens; without finalize the last `pre_lookahead_len` tokens are context only."""
        tokens = torch.cat([prompt_token, token], dim=1)
        x = self.input_embedding(tokens.clamp(min=0))
        context = None
        if not finalize:
            lookahead = self.config.pre_lookahead_len
            x, context = x[:, :-lookahead], x[:, -lookahead:]
        h = self.encoder(x, context, streaming)
        return self.encoder_proj(h).transpose(1, 2)

    @torch.inference_mode()
    def inference(
        self,
        token: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
        streaming: bool = False,
        finalize: bool = True,
    ) -> torch.Tensor:
        """token (B, N), prompt_token (B, P), prompt_feat (B, 2P, 80) time-major, embedding (B, 192) x-vector.

        Returns mel (B, 80, frames) float32 for the new part only: 2N frames, or 2(N - lookahead) without finalize.
        """
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        mu = self.encode(token, prompt_token, streaming, finalize)
        prompt_frames = prompt_feat.size(1)
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.transpose(1, 2)
        mask = torch.ones_like(mu[:, :1])
        mel = self.decoder(mu, mask, spks, cond, streaming)
        return mel[:, :, prompt_frames:]
