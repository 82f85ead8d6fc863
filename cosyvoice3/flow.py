"""CosyVoice3's flow (upstream `CausalMaskedDiffWithDiT`): speech tokens + prompt -> mel (80 bins, 50 frames/s).

Keys equal the released flow.pt: `input_embedding`, `spk_embed_affine_layer`, `pre_lookahead_layer.conv1/conv2`,
`decoder.estimator.*` (the DiT). There is no conformer encoder: the token embeddings (80 wide) go through a
residual lookahead conv pair (each token sees the next 3) and are repeated x2 to the mel rate; that is mu.

One call: tokens = prompt tokens ++ target tokens; mu as above; cond = the prompt mel in the first 2P frames,
zeros after; speaker = L2-normalised x-vector through a linear layer; 10 Euler steps from the first T columns of
a fixed noise table (`torch.manual_seed(0); torch.randn(1, 80, 15000)`, prompt frames included) with CFG 0.7;
the prompt frames are dropped from the result. A non-final streaming call (`finalize=False`) treats its last 3
tokens as lookahead context only (they get no frames); `streaming=True` uses the DiT's 50-frame chunk mask.

The Euler/CFG sampler is CosyVoice2's (`cosyvoice2.flow.cfm.CausalCFM`, the same maths and noise recipe, with its
CUDA graphs): the DiT provides the estimator interface it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.flow.cfm import CausalCFM
from cosyvoice2.flow.config import CFMConfig
from cosyvoice2.flow.encoder import PreLookaheadLayer

from .config import FlowConfig
from .dit import DiT
from .errors import CosyVoice3InputError


@dataclass(frozen=True)
class FlowInputs:
    """What the estimator sees for one call (batch 1): mu and cond (1, 80, T), speaker (1, 80), `prompt_frames`
    of them are the prompt's."""

    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor
    prompt_frames: int

    @property
    def frames(self) -> int:
        return self.mu.shape[2]


class CosyVoice3Flow(nn.Module):
    def __init__(self, config: FlowConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or FlowConfig()
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(config.input_size, config.pre_lookahead_len,
                                                     config.pre_lookahead_channels)
        self.decoder = CausalCFM(DiT(config.dit), CFMConfig(  # type: ignore[arg-type]  # the DiT drives it too
            n_timesteps=config.n_timesteps, inference_cfg_rate=config.inference_cfg_rate,
            noise_frames=config.noise_frames, noise_seed=config.noise_seed))

    @property
    def estimator(self) -> DiT:
        return self.decoder.estimator  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:
        return self.input_embedding.weight.device

    # ---- pieces -----------------------------------------------------------------------------------------
    def _tokens(self, tokens: Sequence[int] | torch.Tensor, what: str) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise CosyVoice3InputError(f"{what} must lie in 0..{self.config.vocab_size - 1}")
        return ids

    def speaker(self, xvector: torch.Tensor) -> torch.Tensor:
        """(B, 192) x-vector -> (B, 80)."""
        return self.spk_embed_affine_layer(F.normalize(xvector.to(self.input_embedding.weight), dim=1))

    def token_features(self, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """(L,) prompt ++ target ids -> lookahead-conv output (1, L or L - lookahead, 80) at the token rate."""
        lookahead = self.config.pre_lookahead_len
        embedded = self.input_embedding(tokens).unsqueeze(0)
        if finalize:
            return self.pre_lookahead_layer(embedded, None, torch.tensor([tokens.numel()], device=self.device))
        if tokens.numel() <= lookahead:
            raise CosyVoice3InputError(f"a non-final flow call needs more than {lookahead} tokens")
        body, context = embedded[:, :-lookahead], embedded[:, -lookahead:]
        return self.pre_lookahead_layer(body, context, torch.tensor([body.shape[1]], device=self.device))

    def inputs(self, tokens: Sequence[int] | torch.Tensor, prompt_tokens: Sequence[int] | torch.Tensor,
               prompt_feat: torch.Tensor, xvector: torch.Tensor, finalize: bool = True) -> FlowInputs:
        """prompt_feat (1, 2P, 80) prompt mel (frames, bins); xvector (1, 192)."""
        prompt = self._tokens(prompt_tokens, "prompt speech tokens")
        target = self._tokens(tokens, "speech tokens")
        ratio = self.config.token_mel_ratio
        if prompt_feat.dim() != 3 or prompt_feat.shape[0] != 1 or prompt_feat.shape[2] != self.config.output_size:
            raise CosyVoice3InputError(f"prompt mel must be (1, frames, {self.config.output_size}), "
                                       f"got {tuple(prompt_feat.shape)}")
        if prompt_feat.shape[1] != ratio * prompt.numel():
            raise CosyVoice3InputError(f"prompt mel has {prompt_feat.shape[1]} frames for {prompt.numel()} prompt "
                                       f"tokens; the flow needs exactly {ratio} per token")
        h = self.token_features(torch.cat([prompt, target]), finalize)
        mu = h.repeat_interleave(ratio, dim=1).transpose(1, 2).contiguous()
        cond = torch.zeros_like(mu)
        prompt_frames = prompt_feat.shape[1]
        # a non-final call over the prompt alone (a voice's flow cache) has fewer frames than the prompt mel
        shown = min(prompt_frames, mu.shape[2])
        cond[:, :, :shown] = prompt_feat[:, :shown].to(mu).transpose(1, 2)
        return FlowInputs(mu, cond, self.speaker(xvector.reshape(1, -1)), prompt_frames)

    # ---- a whole call -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def inference(self, tokens: Sequence[int] | torch.Tensor, prompt_tokens: Sequence[int] | torch.Tensor,
                  prompt_feat: torch.Tensor, xvector: torch.Tensor, streaming: bool = False,
                  finalize: bool = True) -> torch.Tensor:
        """Target mel (1, 80, frames) float32: 2 per target token, minus 2 per lookahead token when not final."""
        inputs = self.inputs(tokens, prompt_tokens, prompt_feat, xvector, finalize)
        mask = torch.ones(1, 1, inputs.frames, dtype=inputs.mu.dtype, device=self.device)
        mel = self.decoder(inputs.mu, mask, inputs.spks, inputs.cond, streaming)
        return mel[:, :, inputs.prompt_frames:].float()
