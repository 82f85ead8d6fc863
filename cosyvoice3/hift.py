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
audio covers all but the last 8 mel frames; the reference vocodes the whole accumulated mel again and emits only
the new samples (there is no cross-fade).

Streaming without re-vocoding the past (`stream_chunks`, `VocoderState`): every layer is causal with a bounded
left reach except one, the harmonic phase, a cumulative sum from the first frame. So a chunk runs the very same
network over a window of the accumulated mel that starts `decoder_context` frames before its first new sample
(plus the f0 predictor's own `f0_context` frames before that), with the source noise read at the window's
absolute sample offset and the phase sum continued from a per-stream float64 state. Whatever the window's left
edge changes (zero conv padding, the STFT's and the last stage's reflection, garbage in a padded row) reaches no
sample at or after its first new one, so the samples equal the whole-mel path's up to float rounding (tested).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice2.host_copies import to_device
from cosyvoice2.hift.generator import HiFTGenerator, _periodic_hann
from cosyvoice2.hift.layers import ResBlock, fold_weight_norm, wn_conv1d
from cosyvoice2.hift.source import HarmonicSource, SourceNoise

from .config import CausalHiFTConfig
from .errors import CosyVoice3InputError

if TYPE_CHECKING:
    from .vocoder_graphs import WindowGraphs


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


class CausalHarmonicSource(HarmonicSource):
    """CosyVoice2's harmonic source with nearest phase upsampling (keys `m_source.l_linear`), plus `window`: the
    same source over frames [a, ...) of a longer signal, given the phase sum of the frames before a."""

    def __init__(self, sampling_rate: int, upsample_scale: int, nb_harmonics: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float) -> None:
        super().__init__(sampling_rate, upsample_scale, nb_harmonics, sine_amp, noise_std, voiced_threshold,
                         phase_upsampling="nearest")

    def window(self, f0: torch.Tensor, sine_noise: torch.Tensor, phase_start: torch.Tensor,
               pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 (B, N) Hz at the frame rate, row b real from frame pad[b] on (its first pad[b] frames are left
        padding); sine_noise (B, 480 N, H) the noise table at the real frames' absolute samples; phase_start (B, H)
        float64: the sum of the phase increments of every frame before the row's first real one
        -> source (B, 1, 480 N) and the running sums (B, N + 1, H) float64 (column m: before window frame m).

        `harmonic_sines` computes each frame's phase increment at the audio rate, takes it back to the frame rate
        by linear interpolation of two equal samples (the increment itself: the initial phase, added to sample 0
        only, is never read) and sums it over frames; on the CPU `cumsum` accumulates float32 in float64, so
        continuing a float64 sum with the same additions in the same order gives the same float32 phases. The
        padded frames add exact zeros."""
        harmonic_numbers = torch.arange(1, self.num_harmonics + 1, device=f0.device, dtype=f0.dtype)
        rad = (f0.unsqueeze(-1) * harmonic_numbers / self.sampling_rate) % 1
        real = torch.arange(f0.shape[1], device=f0.device)[None, :] >= pad[:, None]
        rad = rad * real.unsqueeze(-1)
        sums = torch.cat([phase_start.unsqueeze(1), rad.double()], dim=1).cumsum(1)
        phase_frames = sums[:, 1:].to(f0.dtype) * 2 * math.pi
        phase = (phase_frames * self.upsample_scale).repeat_interleave(self.upsample_scale, dim=1)
        sines = torch.sin(phase) * self.sine_amp
        # HarmonicSource.forward's excitation, on the audio-rate f0
        f0_audio = f0.repeat_interleave(self.upsample_scale, dim=1).unsqueeze(-1)
        voiced = (f0_audio > self.voiced_threshold).to(f0.dtype)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        excitation = sines * voiced + noise_amp * sine_noise.to(sines)
        return torch.tanh(self.l_linear(excitation)).transpose(1, 2), sums


@dataclass(frozen=True)
class VocoderState:
    """One stream's vocoder state between chunks (immutable: each chunk returns a new one).

    mel: the last frames of the stream's mel that a later chunk still reads (all of it on the reference path);
    frames: mel frames so far; sent: samples emitted so far (a multiple of 480); phase (1, H) float64: the phase
    increments summed over the frames before `phase_frame`, where the next window's source starts (None until a
    window needs it)."""

    mel: torch.Tensor
    frames: int = 0
    sent: int = 0
    phase: Optional[torch.Tensor] = None
    phase_frame: int = 0

    @property
    def mel_start(self) -> int:
        return self.frames - self.mel.shape[2]

    def nbytes(self) -> int:
        return self.mel.nbytes + (0 if self.phase is None else self.phase.nbytes)


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
        self.m_source = CausalHarmonicSource(c.sampling_rate, c.samples_per_frame, c.nb_harmonics, c.nsf_alpha,
                                             c.nsf_sigma, c.nsf_voiced_threshold)
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
        self._decoder_context: Optional[int] = None  # `decoder_context()`, computed on first use
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

    # ---- streaming over windows --------------------------------------------------------------------------
    @property
    def f0_context(self) -> int:
        """Mel frames before a frame that its f0 reads (the predictor's left-causal convs; the first looks ahead)."""
        convs = [layer for layer in self.f0_predictor.condnet if isinstance(layer, nn.Conv1d)]
        return sum(conv.dilation[0] * (conv.kernel_size[0] - 1) for conv in convs[1:])

    def decoder_context(self) -> int:
        """Mel frames before an output sample's own frame that `decode_causal` may read for it (mel or source),
        walking back from the output through every layer's left reach, in samples, rounded up to frames."""
        c = self.config
        spf, hop = c.samples_per_frame, c.istft_hop
        n_kernels = len(c.resblock_kernel_sizes)

        def block_reach(block: ResBlock) -> int:  # positions: per dilation, the dilated conv then the plain one
            return sum(a.dilation[0] * (a.kernel_size[0] - 1) + b.dilation[0] * (b.kernel_size[0] - 1)
                       for a, b in zip(block.convs1, block.convs2))

        reach = c.istft_n_fft - 1 - c.istft_n_fft // 2  # the iSTFT frames overlapping a sample start this early
        reach += (self.conv_post.kernel_size[0] - 1) * hop
        source_reach = 0
        rate = spf // hop  # positions per mel frame at the last stage
        for i in reversed(range(len(self.ups))):
            step = spf // rate  # samples per position at stage i
            reach += max(block_reach(block) for block in self.resblocks[i * n_kernels:(i + 1) * n_kernels]) * step
            # the source branch added before the resblocks: its block, the strided conv (left-padded stride - 1),
            # then the centred STFT (a frame reads n_fft / 2 samples before its centre)
            spec = reach + block_reach(self.source_resblocks[i]) * step + (self.source_strides[i] - 1) * hop
            source_reach = max(source_reach, spec + c.istft_n_fft // 2)
            if i == len(self.ups) - 1:
                reach += step  # the one-frame reflection pad: position p holds the conv's p - 1
            reach += (self.ups[i].kernel_size[0] - 1) * step
            reach += (c.upsample_rates[i] - 1) * step  # repeated frames: position p holds floor(p / rate)
            rate //= c.upsample_rates[i]
        return -(-max(reach, source_reach) // spf)  # conv_pre reads only ahead

    def stream_start(self) -> VocoderState:
        """The state of a stream before its first chunk."""
        return VocoderState(self.stft_window.new_zeros(1, self.config.in_channels, 0))

    @torch.inference_mode()
    def reference_chunk(self, state: VocoderState, mel: torch.Tensor, finalize: bool
                        ) -> tuple[torch.Tensor, VocoderState]:
        """The reference: vocode the whole accumulated mel with `mel` (1, 80, n) appended and return the samples
        not sent yet (480 n..., on the vocoder's device) and the state (which keeps every frame)."""
        whole = torch.cat([state.mel, mel.to(state.mel)], dim=2)
        audio = self.inference(whole, finalize)[0][0, state.sent:]
        return audio, VocoderState(whole, whole.shape[2], state.sent + audio.shape[0])

    @torch.inference_mode()
    def stream_chunks(self, rows: Sequence[tuple[VocoderState, torch.Tensor, bool]],
                      graphs: Optional["WindowGraphs"] = None) -> list[tuple[torch.Tensor, VocoderState]]:
        """Each row: a stream's state, its chunk's new mel (1, 80, n) and whether the chunk is final -> the samples
        after those already sent (what `reference_chunk` returns, up to float rounding) and the next state.

        A row vocodes a window from `decoder_context` frames before its first new sample on (its f0 from
        `f0_context` frames before that). Rows whose window starts that late run together, one batch per final
        flag: left-padded to a common length, so every row ends at the same position and the end-of-call
        handling (the final padding and reflection, the non-final truncation) is each row's own; what the padding
        changes stays within the window's discarded head. The first chunks of a stream (its window would start
        before frame 0, where the network's zero padding and reflections are part of the result) run from frame 0,
        unpadded: together only with rows of as many frames (the first chunks of streams of one hop, say).

        `graphs` (`cosyvoice3.vocoder_graphs`): a non-final batch that fits one of their buckets on this device is
        padded to it (more rows, a window further left-padded) and replayed from its CUDA graph (emulated: run on
        its static buffers); the rest runs eagerly."""
        out: list[Optional[tuple[torch.Tensor, VocoderState]]] = [None] * len(rows)
        groups: dict[tuple[bool, bool, int], list[int]] = {}
        for i, (state, mel, finalize) in enumerate(rows):
            windowed, frames = self.window_frames(state.frames + mel.shape[2], state.sent)
            key = (finalize, windowed, 0 if windowed else frames)
            groups.setdefault(key, []).append(i)
        for (finalize, windowed, _), group in groups.items():
            for i, result in zip(group, self._run_windows([rows[i][:2] for i in group], finalize, windowed, graphs)):
                out[i] = result
        return out  # type: ignore[return-value]

    def _window_start(self, sent: int) -> int:
        """The first frame a window must vocode to give the samples from `sent` on."""
        if self._decoder_context is None:
            self._decoder_context = self.decoder_context()
        return sent // self.config.samples_per_frame - self._decoder_context

    def window_frames(self, frames: int, sent: int) -> tuple[bool, int]:
        """A chunk of a stream that has `frames` mel frames with it and `sent` samples before it: whether it runs
        windowed (its window starts after its f0 context; else it runs from frame 0), and the mel frames it
        vocodes (f0 context included)."""
        start = self._window_start(sent)
        windowed = start >= self.f0_context
        return windowed, frames - (start - self.f0_context if windowed else 0)

    def window_pass(self, mel: torch.Tensor, noise: torch.Tensor, phases: torch.Tensor, pads: torch.Tensor,
                    windowed: bool, finalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The network over a batch of windows (static shapes, no host syncs: what `WindowGraphs` captures): mel
        (B, 80, W), every row ending at frame W, f0 context included when `windowed`; noise (B, 480 N, H), phases
        (B, H) float64 and pads (B,) as `CausalHarmonicSource.window` takes them, for the N f0 frames after the f0
        context -> audio (B, samples) and the running phase sums (B, N + 1, H) float64."""
        skip = self.f0_context if windowed else 0
        f0 = self.predict_f0(mel, finalize)[:, skip:]
        source, sums = self.m_source.window(f0, noise, phases, pads)
        return self.decode_causal(mel[:, :, skip:skip + f0.shape[1]], source, finalize), sums

    def _run_windows(self, rows: Sequence[tuple[VocoderState, torch.Tensor]], finalize: bool, windowed: bool,
                     graphs: Optional["WindowGraphs"]) -> list[tuple[torch.Tensor, VocoderState]]:
        c = self.config
        spf, skip = c.samples_per_frame, self.f0_context if windowed else 0
        device = self.stft_window.device
        wholes, mels, starts, ends = [], [], [], []
        for state, mel in rows:
            whole = torch.cat([state.mel, mel.to(state.mel)], dim=2)
            wholes.append(whole)
            start = self._window_start(state.sent) if windowed else 0
            if windowed and state.phase_frame != start:
                raise RuntimeError(f"vocoder state's phase is at frame {state.phase_frame}, the window at {start}")
            if start - skip < state.mel_start:
                raise RuntimeError(f"vocoder state keeps frames from {state.mel_start}, the window needs {start - skip}")
            mels.append(whole[:, :, start - skip - state.mel_start:])
            starts.append(start)
            ends.append(state.frames + mel.shape[2])
        if not finalize and not windowed and ends[0] <= c.held_back_frames:  # nothing to vocode yet (rows alike)
            return [(whole.new_zeros(0), VocoderState(whole, end, state.sent))
                    for (state, _), whole, end in zip(rows, wholes, ends)]
        batch, width = len(rows), max(mel.shape[2] for mel in mels)
        if graphs is not None and device.type != "cuda" and not graphs.emulate:
            graphs = None  # off a GPU the graphs are only emulated
        shape = None if graphs is None else graphs.bucket(batch, width, windowed, finalize, device)
        width = width if shape is None else shape[1]
        padded = torch.cat([F.pad(mel, (width - mel.shape[2], 0)) for mel in mels])
        frames = width - skip - (0 if finalize else c.f0_lookahead)  # the f0 frames after the f0 context
        f0_ends = [end - (0 if finalize else c.f0_lookahead) for end in ends]  # one past each row's last f0 frame
        pads = [frames - (f0_end - start) for f0_end, start in zip(f0_ends, starts)]
        noise = torch.cat([F.pad(self.noise_tables.noise(spf * f0_end, device).sine_noise[:, spf * start:],
                                 (0, 0, spf * pad, 0)) for f0_end, start, pad in zip(f0_ends, starts, pads)])
        zero = torch.zeros(1, c.num_harmonic_channels, dtype=torch.float64, device=device)
        phases = torch.cat([state.phase if windowed else zero for state, _ in rows])  # type: ignore[misc]
        # padded rows (zeros: finite, and rows never mix) are only in the static buffers, which `fill` zero-pads
        inputs = (padded, noise, phases, to_device(pads, device))
        result = None if graphs is None else graphs.replay(  # None: the call runs eagerly (counted)
            shape, inputs, lambda out: (out[0][:batch].clone(), out[1][:batch].clone()))
        audio, sums = result if result is not None else self.window_pass(*inputs, windowed, finalize)
        out = []
        for i, ((state, mel), whole, start, end, pad) in enumerate(zip(rows, wholes, starts, ends, pads)):
            emitted = spf * (end if finalize else end - c.held_back_frames)
            new = audio[i, audio.shape[1] - (emitted - state.sent):]
            if finalize:  # the stream ends: nothing to keep
                out.append((new, VocoderState(mel.new_zeros(1, mel.shape[1], 0), end, emitted)))
                continue
            after = self._window_start(emitted)
            if after >= self.f0_context:  # the next chunk is windowed: keep what its window reads
                keep = whole[:, :, after - self.f0_context - state.mel_start:].clone()
                phase = sums[i:i + 1, pad + after - start].clone()
                out.append((new, VocoderState(keep, end, emitted, phase, after)))
            else:
                out.append((new, VocoderState(whole, end, emitted)))
        return out
