"""CosyVoice3's causal HiFT vocoder (upstream `CausalHiFTGenerator`): mel (80, 50 Hz) -> 24 kHz audio.

The same network shape as CosyVoice2's HiFT (`cosyvoice2.hift`; its residual blocks, Snake, NSF source and
iSTFT head are reused) with every convolution made causal, so a prefix of the mel gives a prefix of the audio:

- f0 predictor: the first conv (kernel 4) looks 3 frames ahead, the other four are left-causal (kernel 3); it
  runs in float64 (the reference casts it at every call: causal f0 is sensitive to rounding);
- conv_pre (kernel 5) looks 4 frames ahead; the upsampling stages repeat each frame (nearest) and apply a
  left-causal conv; the source downsampling convs, residual blocks and conv_post are left-causal;
- the harmonic phase is brought back to the audio rate by repetition (nearest), not interpolation;
- the source noise comes from fixed tables drawn once from a seed (phases (1, 9) with the fundamental's zeroed,
  then uniform [0, 1) noise (1, T, 9)); every call reads them from sample 0. The draws are prefix-stable, so
  only as many samples as the longest call needs are drawn.

A non-final call (`finalize=False`, streaming) has no right context for its last frames: f0 is computed for all
but the last 3 frames, conv_pre for all but 4 more, and the last iSTFT frame (480 samples) is dropped, so the
audio covers all but the last 8 mel frames; a caller vocodes the whole accumulated mel again and emits only the
new samples (there is no cross-fade).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.hift.generator import HiFTGenerator, _periodic_hann
from cosyvoice2.hift.layers import ResBlock, fold_weight_norm, wn_conv1d
from cosyvoice2.hift.source import HarmonicSource, SourceNoise

from .config import CausalHiFTConfig
from .errors import CosyVoice3InputError


class CausalF0Predictor(nn.Module):
    """Keys `condnet.{0,2,4,6,8}` (weight-normed convs, ELU between) and `classifier`."""

    NUM_CONVS = 5

    def __init__(self, in_channels: int, cond_channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        layers: list[nn.Module] = []
        for i in range(self.NUM_CONVS):
            kernel = lookahead + 1 if i == 0 else 3
            layers += [wn_conv1d(in_channels if i == 0 else cond_channels, cond_channels, kernel), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """(B, 80, M) -> f0 in Hz (B, M), or (B, M - lookahead) when not final (the last frames are context)."""
        h = mel if not finalize else F.pad(mel, (0, self.lookahead))
        for layer in self.condnet:
            if isinstance(layer, nn.Conv1d) and layer is not self.condnet[0]:
                h = F.pad(h, (layer.kernel_size[0] - 1, 0))
            h = layer(h)
        return self.classifier(h.transpose(1, 2)).squeeze(-1).abs()


class NoiseTables:
    """The fixed source noise, drawn from `seed`: phases (1, H) (fundamental zeroed), then (1, T, H) uniform noise
    for as many samples as asked so far (re-drawn from the seed when a longer call comes). Drawn on the CPU (the
    recipe's numbers), kept per device, so a streaming vocoder call does not copy its noise to the GPU again."""

    def __init__(self, seed: int, harmonics: int, max_samples: int) -> None:
        self.seed, self.harmonics, self.max_samples = seed, harmonics, max_samples
        self._lock = threading.Lock()
        self._phases: torch.Tensor | None = None  # drawn on first use (not at construction, which may be on meta)
        self._noise = torch.zeros(1, 0, harmonics, device="cpu")
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _draw(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        phases = torch.rand(1, self.harmonics, generator=generator)
        phases[:, 0] = 0
        return phases, torch.rand(1, samples, self.harmonics, generator=generator)

    def noise(self, samples: int, device: torch.device) -> SourceNoise:
        if samples > self.max_samples:
            raise CosyVoice3InputError(f"a vocoder call of {samples} samples exceeds the {self.max_samples}-sample "
                                       "noise table")
        device = torch.device(device)
        with self._lock:
            if self._phases is None or self._noise.shape[1] < samples:
                self._phases, self._noise = self._draw(min(self.max_samples, max(samples, 2 * self._noise.shape[1])))
                self._on_device.clear()
            if device not in self._on_device:
                self._on_device[device] = (self._phases.to(device), self._noise.to(device))
            phases, noise = self._on_device[device]
        return SourceNoise(phases, noise[:, :samples])


class CausalHiFT(HiFTGenerator):
    """Keys equal the released hift.pt. Reuses CosyVoice2's HiFT methods that are the same maths: the centred
    source STFT (`_stft`), the iSTFT head (`synthesize`), checkpoint reading and weight-norm folding; the network
    itself is built here (every part causal)."""

    def __init__(self, config: CausalHiFTConfig | None = None) -> None:
        nn.Module.__init__(self)  # not HiFTGenerator.__init__: its layers are the non-causal ones
        self.config = c = config or CausalHiFTConfig()
        n_stages = len(c.upsample_rates)
        stage_channels = [c.base_channels // 2 ** (i + 1) for i in range(n_stages)]
        n_freq_channels = c.istft_n_fft + 2
        self.m_source = HarmonicSource(c.sampling_rate, c.samples_per_frame, c.nb_harmonics, c.nsf_alpha,
                                       c.nsf_sigma, c.nsf_voiced_threshold, phase_upsampling="nearest")
        self.f0_predictor = CausalF0Predictor(c.in_channels, c.f0_cond_channels, c.f0_lookahead)
        self.conv_pre = wn_conv1d(c.in_channels, c.base_channels, c.conv_pre_look_right + 1)
        self.ups = nn.ModuleList(
            wn_conv1d(c.base_channels // 2 ** i, stage_channels[i], k) for i, k in enumerate(c.upsample_kernel_sizes))
        strides = [1]
        for u in reversed(c.upsample_rates[1:]):
            strides.append(strides[-1] * u)
        self.source_strides = tuple(reversed(strides))  # the source STFT frame rate down to each stage's
        self.source_downs = nn.ModuleList(
            nn.Conv1d(n_freq_channels, ch, 1) if s == 1 else nn.Conv1d(n_freq_channels, ch, 2 * s, s)
            for ch, s in zip(stage_channels, self.source_strides))
        self.source_resblocks = nn.ModuleList(
            ResBlock(ch, k, d, causal=True) for ch, k, d in
            zip(stage_channels, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes))
        self.resblocks = nn.ModuleList(
            ResBlock(ch, k, d, causal=True) for ch in stage_channels
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        self.conv_post = wn_conv1d(stage_channels[-1], n_freq_channels, 7)
        self.register_buffer("stft_window", _periodic_hann(c.istft_n_fft), persistent=False)
        self.noise_tables = NoiseTables(c.noise_seed, c.num_harmonic_channels, c.noise_seconds * c.sampling_rate)
        self.cuda_graphs = None
        self.f0_predictor.double()  # f0 in float64 (the reference computes it so)

    def fold_weight_norm(self) -> int:
        """Fold g * v / |v| once; the f0 predictor's in float64, as the reference evaluates it (a checkpoint
        loaded with `assign=True` brought float32 tensors, so cast first)."""
        self.f0_predictor.double()
        return fold_weight_norm(self)

    # ---- forward ---------------------------------------------------------------------------------------
    def predict_f0(self, speech_feat: torch.Tensor, finalize: bool = True) -> torch.Tensor:  # type: ignore[override]
        """(B, 80, M) -> f0 (B, M) in Hz, (B, M - 3) when not final; computed in float64, returned in the mel's
        dtype. (A `.to(dtype)` of the whole vocoder casts the predictor too; like the reference, it is cast back
        here.)"""
        if next(self.f0_predictor.parameters()).dtype != torch.float64:
            self.f0_predictor.double()
        return self.f0_predictor(speech_feat.double(), finalize).to(speech_feat.dtype)

    def excitation(self, f0: torch.Tensor) -> torch.Tensor:
        """(B, M) f0 -> (B, 1, 480 M) source from the fixed noise tables."""
        samples = f0.shape[1] * self.config.samples_per_frame
        noise = self.noise_tables.noise(samples, f0.device)
        batch = f0.shape[0]
        noise = SourceNoise(noise.initial_phase.expand(batch, -1), noise.sine_noise.expand(batch, -1, -1))
        return self.source(f0, noise)

    def decode_causal(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel (B, 80, M) (the frames the f0 covers) + source (B, 1, 480 M) -> audio (B, 480 M) when final,
        (B, 480 (M - look_right - 1)) otherwise."""
        c = self.config
        hops_per_frame = c.samples_per_frame // c.istft_hop
        samples = torch.full((mel.shape[0],), source.shape[2], dtype=torch.long, device=mel.device)
        spec = self._stft(source.squeeze(1), samples)
        if finalize:
            x = self.conv_pre(F.pad(mel, (0, c.conv_pre_look_right)))
        else:
            x = self.conv_pre(mel)
            spec = spec[:, :, : spec.shape[2] - hops_per_frame * c.conv_pre_look_right]
        n_kernels = len(c.resblock_kernel_sizes)
        for i, (up, down, source_block) in enumerate(zip(self.ups, self.source_downs, self.source_resblocks)):
            x = F.leaky_relu(x, c.lrelu_slope).repeat_interleave(c.upsample_rates[i], dim=2)
            x = up(F.pad(x, (up.kernel_size[0] - 1, 0)))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one extra frame to match the centred source STFT
            x = x + source_block(down(F.pad(spec, (self.source_strides[i] - 1, 0))))
            blocks = self.resblocks[i * n_kernels:(i + 1) * n_kernels]
            mrf = blocks[0](x)
            for block in blocks[1:]:
                mrf = mrf + block(x)
            x = mrf / n_kernels
        x = self.conv_post(F.pad(F.leaky_relu(x), (self.conv_post.kernel_size[0] - 1, 0)))
        n_bins = c.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :n_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, n_bins:])
        frames = torch.full_like(samples, (magnitude.shape[2] - 1) // hops_per_frame)
        audio = self.synthesize(magnitude, phase, frames)
        return audio if finalize else audio[:, : audio.shape[1] - c.samples_per_frame]

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, finalize: bool = True  # type: ignore[override]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 80, M) mel -> (audio, source). Final: 480 M samples; not final: 480 (M - 8) samples (the last
        8 frames need right context), source over 480 (M - 3) samples."""
        held = self.config.held_back_frames
        if not finalize and speech_feat.shape[2] <= held:
            return speech_feat.new_zeros(speech_feat.shape[0], 0), speech_feat.new_zeros(speech_feat.shape[0], 1, 0)
        f0 = self.predict_f0(speech_feat, finalize)
        source = self.excitation(f0)
        mel = speech_feat[:, :, : f0.shape[1]]
        return self.decode_causal(mel, source, finalize), source
