"""HiFTGenerator: mel (80, 50 Hz) -> 24 kHz waveform (NSF source + HiFi-GAN upsampling + iSTFT head).

State-dict keys are exactly those of the released `hift.pt` (weight norm as torch parametrizations).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import HiFTConfig
from .f0_predictor import F0Predictor
from .layers import ResBlock, fold_weight_norm, wn_conv1d, wn_conv_transpose1d
from .source import HarmonicSource, SourceNoise

_CHECKPOINT_PREFIX = "generator."


class HiFTGenerator(nn.Module):
    def __init__(self, config: HiFTConfig = HiFTConfig()) -> None:
        super().__init__()
        self.config = config
        c = config
        n_stages = len(c.upsample_rates)
        stage_channels = [c.base_channels // 2 ** (i + 1) for i in range(n_stages)]
        n_freq_channels = c.istft_n_fft + 2  # real + imag of n_fft/2 + 1 bins

        self.m_source = HarmonicSource(c.sampling_rate, c.samples_per_frame, c.nb_harmonics, c.nsf_alpha,
                                       c.nsf_sigma, c.nsf_voiced_threshold)
        self.f0_predictor = F0Predictor(c.in_channels, c.f0_cond_channels)
        self.conv_pre = wn_conv1d(c.in_channels, c.base_channels, 7, padding=3)
        self.ups = nn.ModuleList(
            wn_conv_transpose1d(c.base_channels // 2 ** i, stage_channels[i], k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(c.upsample_rates, c.upsample_kernel_sizes)))

        # The source STFT (one frame per iSTFT hop) is strided down to each stage's time resolution.
        source_strides = [1]
        for u in reversed(c.upsample_rates[1:]):
            source_strides.append(source_strides[-1] * u)
        source_strides.reverse()
        self.source_downs = nn.ModuleList(
            nn.Conv1d(n_freq_channels, ch, 1) if stride == 1
            else nn.Conv1d(n_freq_channels, ch, 2 * stride, stride, padding=stride // 2)
            for ch, stride in zip(stage_channels, source_strides))
        self.source_resblocks = nn.ModuleList(
            ResBlock(ch, k, d) for ch, k, d in
            zip(stage_channels, c.source_resblock_kernel_sizes, c.source_resblock_dilation_sizes))
        self.resblocks = nn.ModuleList(
            ResBlock(ch, k, d) for ch in stage_channels
            for k, d in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes))
        self.conv_post = wn_conv1d(stage_channels[-1], n_freq_channels, 7, padding=3)
        self.register_buffer("stft_window", _periodic_hann(c.istft_n_fft), persistent=False)
        self.cuda_graphs: HiFTGraphs | None = HiFTGraphs(self)

    # ---- loading -------------------------------------------------------------------------------------
    @staticmethod
    def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
        """Read hift.pt; strip the optional `generator.` key prefix that some checkpoints carry."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {k.removeprefix(_CHECKPOINT_PREFIX): v for k, v in state.items()}

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: HiFTConfig = HiFTConfig(),
                        device: torch.device | str = "cpu", fold: bool = False) -> "HiFTGenerator":
        model = cls(config)
        model.load_state_dict(cls.read_state_dict(path), strict=True)
        if fold:
            model.fold_weight_norm()
        return model.to(device).eval()

    def fold_weight_norm(self) -> int:
        """Fold g * v / ||v|| into plain weights once (faster inference, same output up to rounding)."""
        return fold_weight_norm(self)

    # ---- forward pieces --------------------------------------------------------------------------------
    def predict_f0(self, speech_feat: torch.Tensor) -> torch.Tensor:
        """(B, 80, M) mel -> (B, M) f0 in Hz."""
        return self.f0_predictor(speech_feat)

    def source(self, f0: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        """(B, M) f0 -> (B, 1, M * samples_per_frame) excitation."""
        f0_audio_rate = f0.repeat_interleave(self.config.samples_per_frame, dim=1).unsqueeze(-1)
        return self.m_source(f0_audio_rate, noise)

    def decode(self, speech_feat: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """(B, 80, M) mel + (B, 1, T) source -> (B, T) audio clamped to +-audio_limit."""
        return self.synthesize(*self.spectrum(speech_feat, source))

    def spectrum(self, speech_feat: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 80, M) mel + (B, 1, T) source -> iSTFT magnitude and phase, each (B, n_fft/2 + 1, frames)."""
        c = self.config
        source_spec = self._stft(source.squeeze(1))
        n_kernels = len(c.resblock_kernel_sizes)
        x = self.conv_pre(speech_feat)
        for i, (up, source_down, source_block) in enumerate(zip(self.ups, self.source_downs,
                                                                 self.source_resblocks)):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one extra frame to match the centred source STFT
            x = x + source_block(source_down(source_spec))
            blocks = self.resblocks[i * n_kernels:(i + 1) * n_kernels]
            mrf = blocks[0](x)
            for block in blocks[1:]:
                mrf = mrf + block(x)
            x = mrf / n_kernels
        x = self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as upstream
        n_bins = c.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :n_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, n_bins:])
        return magnitude, phase

    def synthesize(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """iSTFT of magnitude/phase -> (B, T) audio clamped to +-audio_limit (kept out of CUDA graphs: torch.istft
        checks its window on the host)."""
        c = self.config
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        audio = torch.istft(spectrum, c.istft_n_fft, c.istft_hop, c.istft_n_fft, window=self.stft_window)
        return audio.clamp(-c.audio_limit, c.audio_limit)

    def _stft(self, signal: torch.Tensor) -> torch.Tensor:
        c = self.config
        spec = torch.stft(signal, c.istft_n_fft, c.istft_hop, c.istft_n_fft, window=self.stft_window,
                          center=True, pad_mode="reflect", return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def draw_noise(self, batch: int, num_frames: int, generator: torch.Generator | None = None) -> SourceNoise:
        return SourceNoise.draw(batch, num_frames * self.config.samples_per_frame,
                                self.config.num_harmonic_channels, generator, self.stft_window.device)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, cache_source: torch.Tensor | None = None,
                  noise: SourceNoise | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 80, M) mel -> (audio (B, 480 M), source (B, 1, 480 M)).

        cache_source (B, 1, S): source samples of the previous streaming chunk; they overwrite the start
        of this chunk's source so the excitation phase stays continuous. `noise` injects the random draws;
        otherwise they are drawn from `generator` (torch's default generator when None). On CUDA, shapes seen
        before are replayed from CUDA graphs (`cuda_graphs`; None runs eagerly).
        """
        if noise is None:
            noise = self.draw_noise(speech_feat.shape[0], speech_feat.shape[2], generator)
        if cache_source is None:
            cache_source = speech_feat.new_zeros(speech_feat.shape[0], 1, 0)
        if self.cuda_graphs is not None and speech_feat.is_cuda:
            magnitude, phase, source = self.cuda_graphs.run(speech_feat, noise, cache_source)
        else:
            magnitude, phase, source = self.vocode(speech_feat, noise.initial_phase, noise.sine_noise, cache_source)
        return self.synthesize(magnitude, phase), source

    def vocode(self, speech_feat: torch.Tensor, initial_phase: torch.Tensor, sine_noise: torch.Tensor,
               cache_source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`inference` up to the iSTFT on explicit tensors -> (magnitude, phase, source): static shapes, no host
        syncs (what `HiFTGraphs` captures)."""
        f0 = self.predict_f0(speech_feat)
        source = self.source(f0, SourceNoise(initial_phase, sine_noise))
        if cache_source.shape[2] > 0:
            source[:, :, :cache_source.shape[2]] = cache_source
        return *self.spectrum(speech_feat, source), source


class _CapturedVocode:
    """One captured `vocode` call: static input buffers, the graph, its output buffers."""

    def __init__(self, hift: HiFTGenerator, inputs: tuple[torch.Tensor, ...], pool: object) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (cuDNN/cuFFT plans, lazy inits)
            hift.vocode(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = hift.vocode(*self.inputs)


class HiFTGraphs:
    """CUDA graphs of `HiFTGenerator.vocode` (everything but the iSTFT) per input shape. HiFT is launch-bound (its time hardly depends on the
    length), but lengths cannot be padded (non-causal convolutions), so a shape is captured on its second
    occurrence: streaming chunk lengths repeat, one-off final-chunk lengths stay eager. At most `max_graphs`."""

    def __init__(self, hift: HiFTGenerator, max_graphs: int = 32) -> None:
        self._hift = [hift]  # a list, so the module is not registered as a child
        self.max_graphs = max_graphs
        self._seen: set[tuple] = set()
        self._captured: dict[tuple, _CapturedVocode] = {}
        self._pool: object | None = None
        self._lock = threading.Lock()

    def run(self, speech_feat: torch.Tensor, noise: SourceNoise,
            cache_source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hift = self._hift[0]
        inputs = (speech_feat, noise.initial_phase.to(speech_feat), noise.sine_noise.to(speech_feat), cache_source)
        key = (speech_feat.device, *(tuple(t.shape) for t in inputs))
        with self._lock:
            captured = self._captured.get(key)
            if captured is None:
                if key not in self._seen or len(self._captured) >= self.max_graphs:
                    self._seen.add(key)
                    return hift.vocode(*inputs)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                captured = self._captured[key] = _CapturedVocode(hift, inputs, self._pool)
            for static, value in zip(captured.inputs, inputs):
                static.copy_(value)
            captured.graph.replay()
            return tuple(t.clone() for t in captured.outputs)


def _periodic_hann(n: int) -> torch.Tensor:
    # computed in float64 then rounded, like scipy's get_window('hann', n, fftbins=True) upstream
    return torch.hann_window(n, periodic=True, dtype=torch.float64).float()
