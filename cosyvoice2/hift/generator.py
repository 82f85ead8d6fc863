"""HiFTGenerator: mel (80, 50 Hz) -> 24 kHz waveform (NSF source + HiFi-GAN upsampling + iSTFT head).

State-dict keys are exactly those of the released `hift.pt` (weight norm as torch parametrizations).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.host_copies import to_device

from speech_lm.graph_buckets import PaddedCallGraphs, costliest_first, fit, round_up
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
        # no buckets until a server sets them (`HiFTGraphs.use_buckets`) and captures them: every call is eager
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
    # A batch may hold rows of different lengths, right-padded: `frames` (B,) gives each row's real mel frames.
    # Every layer re-zeroes the padded positions (the zero padding a row sees alone), the source STFT reflects
    # each row at its own end, and the iSTFT overlap-adds and normalises each row over its own frames, so a
    # row's real samples are those of running it alone (exact up to float rounding; tested).
    def predict_f0(self, speech_feat: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 80, M) mel -> (B, M) f0 in Hz (0 on padded frames, so the source phase stops there)."""
        return self.f0_predictor(speech_feat, mask)

    def source(self, f0: torch.Tensor, noise: SourceNoise) -> torch.Tensor:
        """(B, M) f0 -> (B, 1, M * samples_per_frame) excitation."""
        f0_audio_rate = f0.repeat_interleave(self.config.samples_per_frame, dim=1).unsqueeze(-1)
        return self.m_source(f0_audio_rate, noise)

    def decode(self, speech_feat: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """(B, 80, M) mel + (B, 1, T) source -> (B, T) audio clamped to +-audio_limit (rows of full length)."""
        frames = self._full_lengths(speech_feat, speech_feat.shape[2])
        return self.synthesize(*self.spectrum(speech_feat, source, frames), frames)

    def spectrum(self, speech_feat: torch.Tensor, source: torch.Tensor,
                 frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 80, M) mel + (B, 1, T) source -> iSTFT magnitude and phase, each (B, n_fft/2 + 1, stft frames)."""
        c = self.config
        hops_per_frame = c.samples_per_frame // c.istft_hop
        source_spec = self._stft(source.squeeze(1), frames * c.samples_per_frame)
        source_spec = source_spec * _length_mask(frames * hops_per_frame + 1, source_spec)
        n_kernels = len(c.resblock_kernel_sizes)
        mask = _length_mask(frames, speech_feat)
        x = self.conv_pre(speech_feat * mask) * mask
        real = frames
        for i, (up, source_down, source_block) in enumerate(zip(self.ups, self.source_downs,
                                                                 self.source_resblocks)):
            x = up(F.leaky_relu(x, c.lrelu_slope))
            real = real * c.upsample_rates[i]
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one extra frame to match the centred source STFT
                real = real + 1
            mask = _length_mask(real, x)
            x = x * mask
            x = x + source_block(source_down(source_spec) * mask, mask)
            blocks = self.resblocks[i * n_kernels:(i + 1) * n_kernels]
            mrf = blocks[0](x, mask)
            for block in blocks[1:]:
                mrf = mrf + block(x, mask)
            x = mrf / n_kernels
        x = self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as upstream
        n_bins = c.istft_n_fft // 2 + 1
        magnitude = torch.exp(x[:, :n_bins]).clamp(max=1e2)
        phase = torch.sin(x[:, n_bins:])
        return magnitude, phase

    def synthesize(self, magnitude: torch.Tensor, phase: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """Centred iSTFT of magnitude/phase -> (B, 480 M) audio clamped to +-audio_limit; row b is real up to
        480 frames[b]. Written out (irfft, window, overlap-add, divide by the row's own window envelope) rather
        than torch.istft, whose envelope would span the padded frames and whose window check syncs the host."""
        c = self.config
        n_fft, hop = c.istft_n_fft, c.istft_hop
        n_frames = magnitude.shape[2]
        frame_mask = _length_mask(frames * (c.samples_per_frame // hop) + 1, magnitude)
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        window = self.stft_window.view(1, n_fft, 1)
        segments = torch.fft.irfft(spectrum, n=n_fft, dim=1) * window * frame_mask  # (B, n_fft, frames)
        length = n_fft + hop * (n_frames - 1)

        def overlap_add(columns: torch.Tensor) -> torch.Tensor:
            return F.fold(columns, (1, length), (1, n_fft), stride=(1, hop)).view(columns.shape[0], length)

        trim = slice(n_fft // 2, length - n_fft // 2)
        audio = overlap_add(segments)[:, trim]
        envelope = overlap_add((window * window * frame_mask).expand_as(segments))[:, trim]
        audio = audio / envelope.clamp(min=1e-11)  # 0 only beyond a row's end, where audio is 0 too
        return audio.clamp(-c.audio_limit, c.audio_limit)

    def _stft(self, signal: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
        """Centred STFT of (B, T) rows, each reflect-padded at its own end (`samples` real samples)."""
        c = self.config
        pad = c.istft_n_fft // 2
        length = signal.shape[1]
        index = torch.arange(-pad, length + pad, device=signal.device).abs().unsqueeze(0)  # reflect at 0
        last = (samples - 1).unsqueeze(1)
        index = torch.where(index > last, 2 * last - index, index).clamp(0, length - 1)  # reflect at the end
        padded = signal.gather(1, index)
        spec = torch.stft(padded, c.istft_n_fft, c.istft_hop, c.istft_n_fft, window=self.stft_window,
                          center=False, return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def draw_noise(self, batch: int, num_frames: int, generator: torch.Generator | None = None) -> SourceNoise:
        return SourceNoise.draw(batch, num_frames * self.config.samples_per_frame,
                                self.config.num_harmonic_channels, generator, self.stft_window.device)

    @staticmethod
    def _full_lengths(like: torch.Tensor, length: int) -> torch.Tensor:
        return torch.full((like.shape[0],), length, dtype=torch.long, device=like.device)

    @torch.inference_mode()
    def inference(self, speech_feat: torch.Tensor, cache_source: torch.Tensor | None = None,
                  noise: SourceNoise | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 80, M) mel -> (audio (B, 480 M), source (B, 1, 480 M)).

        cache_source (B, 1, S): source samples of the previous streaming chunk; they overwrite the start
        of this chunk's source so the excitation phase stays continuous. `noise` injects the random draws;
        otherwise they are drawn from `generator` (torch's default generator when None). A call that fits a
        captured bucket of `cuda_graphs` is replayed from its CUDA graph (None: always eager).
        """
        if noise is None:
            noise = self.draw_noise(speech_feat.shape[0], speech_feat.shape[2], generator)
        if cache_source is None:
            cache_source = speech_feat.new_zeros(speech_feat.shape[0], 1, 0)
        return self._run(speech_feat, self._full_lengths(speech_feat, speech_feat.shape[2]), noise.initial_phase,
                         noise.sine_noise, cache_source, self._full_lengths(speech_feat, cache_source.shape[2]))

    @torch.inference_mode()
    def inference_batch(self, mels: Sequence[torch.Tensor], cache_sources: Sequence[torch.Tensor | None],
                        noises: Sequence[SourceNoise]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several independent calls in one forward: mel (1, 80, M_i), its cache source (1, 1, S_i) or None and
        its noise (drawn for M_i frames, as a call alone would draw it) -> [(audio (480 M_i,), source (1, 1, 480 M_i))].

        Rows are right-padded to the longest and masked (see above), so each result equals `inference` of that
        row alone. Rows longer than every graph bucket (offline utterances) run in a forward of their own, so
        that they do not make the other rows' call eager.
        """
        out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(mels)  # type: ignore[list-item]
        for rows in self._row_groups([mel.shape[2] for mel in mels], mels[0].device):
            results = self._vocode_rows([mels[i] for i in rows], [cache_sources[i] for i in rows],
                                        [noises[i] for i in rows])
            for i, result in zip(rows, results):
                out[i] = result
        return out

    def _row_groups(self, frames: Sequence[int], device: torch.device) -> list[list[int]]:
        """The rows that fit the graphs' longest bucket, and the longer ones (each group non-empty)."""
        longest = self.cuda_graphs.longest_frames(device) if self.cuda_graphs is not None else None
        if longest is None:
            return [list(range(len(frames)))]
        fitting = [i for i, m in enumerate(frames) if m <= longest]
        longer = [i for i, m in enumerate(frames) if m > longest]
        return [rows for rows in (fitting, longer) if rows]

    def _vocode_rows(self, mels: Sequence[torch.Tensor], cache_sources: Sequence[torch.Tensor | None],
                     noises: Sequence[SourceNoise]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        spf = self.config.samples_per_frame
        frames = [mel.shape[2] for mel in mels]
        longest = max(frames)
        caches = [c if c is not None else mels[0].new_zeros(1, 1, 0) for c in cache_sources]
        cache_len = max(c.shape[2] for c in caches)

        def lengths(values: list[int]) -> torch.Tensor:
            return to_device(values, mels[0].device, torch.long)

        audio, source = self._run(
            torch.cat([F.pad(mel, (0, longest - mel.shape[2])) for mel in mels]),
            lengths(frames),
            torch.cat([n.initial_phase for n in noises]),
            torch.cat([F.pad(n.sine_noise, (0, 0, 0, longest * spf - n.sine_noise.shape[1])) for n in noises]),
            torch.cat([F.pad(c, (0, cache_len - c.shape[2])) for c in caches]),
            lengths([c.shape[2] for c in caches]),
        )
        return [(audio[i, : m * spf], source[i : i + 1, :, : m * spf]) for i, m in enumerate(frames)]

    def _run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        graphs = self.cuda_graphs
        if graphs is not None and (inputs[0].is_cuda or graphs.emulate):
            return graphs.run(*inputs)
        return self.vocode(*inputs)

    def vocode(self, speech_feat: torch.Tensor, frames: torch.Tensor, initial_phase: torch.Tensor,
               sine_noise: torch.Tensor, cache_source: torch.Tensor,
               cache_samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole vocoder on explicit tensors (static shapes, no host syncs: what `HiFTGraphs` captures).

        speech_feat (B, 80, M) with `frames` (B,) real frames per row; initial_phase (B, H); sine_noise
        (B, 480 M, H); cache_source (B, 1, S) with `cache_samples` (B,) real samples per row
        -> (audio (B, 480 M), source (B, 1, 480 M)), each row real up to 480 frames[b].
        """
        f0 = self.predict_f0(speech_feat, _length_mask(frames, speech_feat))
        source = self.source(f0, SourceNoise(initial_phase, sine_noise))
        if cache_source.shape[2] > 0:
            head = source[:, :, :cache_source.shape[2]]
            cached = _length_mask(cache_samples, cache_source).bool()
            source[:, :, :cache_source.shape[2]] = torch.where(cached, cache_source, head)
        return self.synthesize(*self.spectrum(speech_feat, source, frames), frames), source


def _length_mask(lengths: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) lengths -> (B, 1, T) mask in like's dtype for a (B, C, T) tensor: 1 on each row's first lengths[b]."""
    positions = torch.arange(like.shape[-1], device=like.device)
    return (positions < lengths.unsqueeze(1)).unsqueeze(1).to(like.dtype)


#: Mel-frame buckets of the HiFT graphs are multiples of this (a call is padded by fewer frames than this).
FRAME_STEP = 16

Shape = tuple[int, int]  # (rows, mel frames) of a padded HiFT call


@dataclass(frozen=True)
class HiFTBuckets:
    """The padded shapes HiFT calls replay from CUDA graphs: rows x mel frames, and one cache-source length.

    The cache source (the previous chunk's last source samples) is padded to `cache_samples` in every call -
    its real length per row is masked by `cache_samples` of `vocode` - so it does not multiply the graphs."""

    rows: tuple[int, ...] = ()
    frames: tuple[int, ...] = ()
    cache_samples: int = 0

    @classmethod
    def covering(cls, frames: Iterable[int], rows: Sequence[int], cache_samples: int,
                 frame_step: int = FRAME_STEP) -> "HiFTBuckets":
        """Buckets for calls of these mel-frame counts (each rounded up to `frame_step`) and row counts."""
        return cls(tuple(sorted(set(rows))), tuple(sorted({round_up(f, frame_step) for f in frames})), cache_samples)

    def fit(self, rows: int, frames: int, cache_samples: int) -> Optional[Shape]:
        """The bucket a call is padded to, or None (it runs eagerly)."""
        if cache_samples > self.cache_samples:
            return None
        return fit((rows, frames), (self.rows, self.frames))  # type: ignore[return-value]

    def shapes(self) -> list[Shape]:
        """Every bucket, the largest first: a smaller capture then reuses the pool blocks a larger one freed."""
        return costliest_first((self.rows, self.frames))  # type: ignore[return-value]


class HiFTGraphs(PaddedCallGraphs):
    """CUDA graphs of `HiFTGenerator.vocode`, one per bucket (`HiFTBuckets`: rows x mel frames). Eagerly HiFT is
    launch-bound at a few rows (its time hardly depends on the size there), and padding is exact (masks), so a
    call is padded to its bucket - rows with 0 frames, zero mel frames, the cache source to the buckets' fixed
    length - and replays that bucket's graph (`PaddedCallGraphs`: captured all at once, eager and counted
    outside them). The static buffers hold the sine noise - (rows, 480 x frames, 9) fp32, 59 MiB at 16 rows x
    224 frames - once, not once per graph."""

    outputs = 2  # audio, source

    def __init__(self, hift: HiFTGenerator, buckets: HiFTBuckets = HiFTBuckets()) -> None:
        super().__init__()
        self._hift = [hift]  # a list, so the module is not registered as a child
        self.buckets = buckets

    # ---- buckets and capture --------------------------------------------------------------------------
    def use_buckets(self, buckets: HiFTBuckets) -> None:
        """Replace the buckets (dropping any graph captured for the old ones)."""
        spf = self._hift[0].config.samples_per_frame
        if buckets.frames and min(buckets.frames) * spf < buckets.cache_samples:
            raise ValueError(f"HiFT frame buckets {buckets.frames} are shorter than the cache source "
                             f"({buckets.cache_samples} samples)")
        with self._lock:
            self.buckets = buckets
            self._clear()

    def _layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
        """The `vocode` inputs of a bucket, then its outputs (audio, source)."""
        rows, frames = shape
        c = self._hift[0].config
        samples = frames * c.samples_per_frame
        harmonics = c.num_harmonic_channels
        return {"speech_feat": ((rows, c.in_channels, frames), dtype), "frames": ((rows,), torch.long),
                "initial_phase": ((rows, harmonics), dtype), "sine_noise": ((rows, samples, harmonics), dtype),
                "cache_source": ((rows, 1, self.buckets.cache_samples), dtype), "cache_samples": ((rows,), torch.long),
                "audio": ((rows, samples), dtype), "source": ((rows, 1, samples), dtype)}

    def _pass(self, shape: tuple[int, ...]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return self._hift[0].vocode

    # ---- calls ------------------------------------------------------------------------------------------
    def longest_frames(self, device: torch.device) -> Optional[int]:
        """The most mel frames a call on `device` can replay with (None: no call there replays)."""
        if not self.buckets.frames or not self.replays_on(device):
            return None
        return max(self.buckets.frames)

    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`vocode` of these inputs: replayed from their bucket's graph (padded rows have 0 frames: all masked),
        else eagerly (counted)."""
        speech_feat, cache_source = inputs[0], inputs[4]
        batch, _, length = speech_feat.shape
        samples = length * self._hift[0].config.samples_per_frame
        replayed = self.replay(self.buckets.fit(batch, length, cache_source.shape[2]), inputs,
                               lambda out: (out[0][:batch, :samples].clone(), out[1][:batch, :, :samples].clone()))
        return replayed if replayed is not None else self._hift[0].vocode(*inputs)


def _periodic_hann(n: int) -> torch.Tensor:
    # computed in float64 then rounded, like scipy's get_window('hann', n, fftbins=True) upstream
    return torch.hann_window(n, periodic=True, dtype=torch.float64).float()
