"""CausalFlow: speech tokens (+ prompt tokens/mel, x-vector) -> mel for the new tokens
(docs/reference/cosyvoice2.md#flow-inference-and-lengths)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.host_copies import to_device

from .cfm import CausalCFM
from .config import FlowConfig
from .encoder import UpsampleConformerEncoder
from .estimator import CausalUNetEstimator


class CausalFlow(nn.Module):
    """State-dict keys equal upstream flow.pt (CausalMaskedDiffWithXvec).

    Rows of different lengths run in one forward (`inference_batch`): right-padded and masked in the encoder
    and the estimator, each row's mel equals a call of that row alone; batch 1 reproduces upstream exactly.
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
        lookahead = 0 if finalize else self.config.pre_lookahead_len
        lengths = torch.full((tokens.size(0),), tokens.size(1) - lookahead, device=tokens.device)
        context = tokens[:, tokens.size(1) - lookahead :] if lookahead else None
        return self.encode_padded(tokens[:, : tokens.size(1) - lookahead], context, lengths, streaming)

    def encode_padded(
        self, tokens: torch.Tensor, context: Optional[torch.Tensor], lengths: torch.Tensor, streaming: bool
    ) -> torch.Tensor:
        """tokens (B, T) right-padded with `lengths` (B,) real tokens, context (B, lookahead) tokens that follow
        each row (None: zeros, the finalized call) -> mu (B, 80, 2T), real up to 2 lengths[b]."""
        x = self.input_embedding(tokens.clamp(min=0))
        context_x = None if context is None else self.input_embedding(context.clamp(min=0))
        h = self.encoder(x, context_x, streaming, lengths)
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
        return torch.stack(
            self.inference_batch(list(token), list(prompt_token), list(prompt_feat), embedding, streaming, finalize)
        )

    @torch.inference_mode()
    def inference_batch(
        self,
        tokens: Sequence[torch.Tensor],
        prompt_tokens: Sequence[torch.Tensor],
        prompt_feats: Sequence[torch.Tensor],
        embeddings: torch.Tensor,
        streaming: bool = False,
        finalize: bool = True,
    ) -> list[torch.Tensor]:
        """Independent calls of any lengths in one forward: tokens[i] (N_i,), prompt_tokens[i] (P_i,),
        prompt_feats[i] (2 P_i, 80), embeddings (B, 192) -> [mel (80, frames_i) float32 of the new part]
        (frames_i as in `inference`).

        The streaming chunk grid counts from each row's first prompt token, so right padding keeps every
        row's grid; padded frames get mask 0 (and zero mu/cond) in the estimator, as the CFM's bucket padding.
        """
        lookahead = 0 if finalize else self.config.pre_lookahead_len
        sequences = [torch.cat([p, t]) for p, t in zip(prompt_tokens, tokens, strict=True)]
        lengths = [s.numel() - lookahead for s in sequences]
        longest = max(lengths)
        ids = torch.stack([F.pad(s[:n], (0, longest - n)) for s, n in zip(sequences, lengths)])
        context = torch.stack([s[n:] for s, n in zip(sequences, lengths)]) if lookahead else None
        stride = self.config.token_mel_ratio
        frames = to_device(lengths, ids.device) * stride
        mu = self.encode_padded(ids, context, frames // stride, streaming)
        mask = (torch.arange(mu.size(-1), device=mu.device) < frames.unsqueeze(1)).unsqueeze(1).to(mu.dtype)
        mu = mu * mask
        cond = torch.zeros_like(mu)
        for row, feat in enumerate(prompt_feats):
            cond[row, :, : feat.size(0)] = feat.transpose(0, 1)
        spks = self.spk_embed_affine_layer(F.normalize(embeddings, dim=1))
        mel = self.decoder(mu, mask, spks, cond, streaming)
        return [mel[row, :, feat.size(0) : n * stride] for row, (feat, n) in enumerate(zip(prompt_feats, lengths))]
