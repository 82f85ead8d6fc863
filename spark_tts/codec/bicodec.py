"""BiCodec: the audio tokenizer's model half (semantic + global tokens) and the decoder to a 16 kHz waveform.

Submodule names equal the released ``BiCodec/model.safetensors`` keys (``encoder``, ``quantizer``,
``speaker_encoder``, ``prenet``, ``postnet``, ``decoder``), so the checkpoint loads without renaming once its
weight-normed layers are folded. ``postnet`` only served training (feature reconstruction); it is kept for the
strict load and never run.
"""

from __future__ import annotations

import torch
from torch import nn

from spark_tts.codec.mel import MelSpectrogram
from spark_tts.codec.semantic import FactorizedVQ, FeatureDecoder, FeatureEncoder
from spark_tts.codec.speaker import EcapaWidths, SpeakerEncoder
from spark_tts.codec.wave import WaveGenerator
from spark_tts.config import BiCodecConfig


class BiCodec(nn.Module):
    def __init__(self, config: BiCodecConfig | None = None, widths: EcapaWidths | None = None) -> None:
        super().__init__()
        self.config = config = config or BiCodecConfig()
        self.encoder = FeatureEncoder(config.encoder)
        self.quantizer = FactorizedVQ(config.quantizer)
        self.speaker_encoder = SpeakerEncoder(config.speaker, widths or EcapaWidths())
        self.prenet = FeatureDecoder(config.prenet)
        self.postnet = FeatureDecoder(config.postnet)
        self.decoder = WaveGenerator(config.decoder)
        self.mel = MelSpectrogram(config.mel)

    def weight_normed(self) -> list[str]:
        """Layers stored as ``weight_g``/``weight_v`` in the released checkpoint."""
        return ["quantizer.in_project", "quantizer.out_project",
                *(f"decoder.{name}" for name in self.decoder.weight_normed())]

    # ---- tokenizer half ----------------------------------------------------------------------------------------
    def semantic_latent(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """wav2vec2 mixed features ``[B, T, C]`` (mask ``[B, T]``, 1 = real frame) -> latent ``[B, C', T]``."""
        frame_mask = None if mask is None else mask.to(features.dtype).unsqueeze(1)
        return self.encoder(features.transpose(1, 2), frame_mask)

    def semantic_tokens(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` ids (entries past a sequence's length are meaningless)."""
        return self.quantizer.tokenize(self.semantic_latent(features, mask))

    def global_tokens(self, ref_clip: torch.Tensor) -> torch.Tensor:
        """Speaker reference clips ``[B, samples]`` (all the same length) -> ``[B, token_num]`` ids."""
        return self.speaker_encoder.tokenize(self.mel(ref_clip))

    # ---- decoder half --------------------------------------------------------------------------------------------
    def d_vector(self, global_tokens: torch.Tensor) -> torch.Tensor:
        return self.speaker_encoder.detokenize(global_tokens)

    def decoder_input(self, semantic_tokens: torch.Tensor, global_tokens: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, C, T]``: prenet(codes conditioned on the d-vector) plus the d-vector on every frame."""
        d_vector = self.d_vector(global_tokens)
        return self.prenet(self.quantizer.detokenize(semantic_tokens), d_vector, mask) + d_vector.unsqueeze(-1)

    def detokenize(self, semantic_tokens: torch.Tensor, global_tokens: torch.Tensor,
                   lengths: torch.Tensor | None = None) -> torch.Tensor:
        """semantic ``[B, T]`` + global ``[B, token_num]`` -> waveform ``[B, T * hop]`` at 16 kHz, in [-1, 1].

        lengths ``[B]``: rows of different lengths right-padded to T; row b's first ``lengths[b] * hop`` samples
        then equal its solo output (masked convolutions), the rest is junk.
        """
        mask = None
        if lengths is not None:
            positions = torch.arange(semantic_tokens.shape[1], device=semantic_tokens.device)
            mask = (positions.unsqueeze(0) < lengths.to(positions.device).unsqueeze(1)).unsqueeze(1)
            mask = mask.to(self.decoder.model[0].weight.dtype)
        return self.decoder(self.decoder_input(semantic_tokens, global_tokens, mask), mask).squeeze(1)
