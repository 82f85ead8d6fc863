"""CUDA graphs of CosyVoice3's windowed vocoder (`CausalHiFT.stream_chunks`), in padded shape buckets.

Eagerly the causal HiFT launches hundreds of small kernels per call (its 80-odd convolutions, each with its padding
and activation), so a call of a few streaming rows mostly waits for the host (as CosyVoice2's HiFT,
`cosyvoice2.hift.generator.HiFTGraphs`). A non-final call is therefore padded to a bucket of (rows, mel frames) and replays the one graph captured for it
(`WindowGraphs`, on `speech_lm.graph_buckets.PaddedCallGraphs`: static buffers shared by every bucket, one pool,
every graph captured before a server reports ready). What the graph takes is what `CausalHiFT.window_pass` takes:
the rows' mel windows, their source noise at each window's absolute sample offset, their phase sums and left
padding; the host keeps the rest (the windows' bookkeeping, the states), as eagerly.

Two kinds of non-final calls, two kinds of buckets:

- windowed (a stream's third chunk on): its rows already run left-padded to their longest window, every row ending
  at the same position; a bucket pads every row further on the left, within the window's discarded head, which
  reaches no emitted sample (`CausalHiFT`'s module docstring), so the samples are the unpadded call's up to float
  rounding. Buckets: per chunk index the window of that index's hop, rounded up to `FRAME_STEP`;
- from frame 0 (a stream's first chunks): the network's start (zero padding, reflections) is part of the result,
  so these run at their own frame count; a bucket is exactly that count, one per chunk index that runs so.

Padded rows are zeros (finite; rows never mix). Final calls (one per stream, of any length) run eagerly, as the
flow's final chunks do by default, and so does a call of more rows or a longer window than every bucket (a chunk
past the flow graphs' longest, `cosyvoice3.graphs.MAX_FRAMES` new frames) and every call before `capture_all`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch

from cosyvoice2.dit.graphs import HopSchedule
from speech_lm.graph_buckets import PaddedCallGraphs, fit, round_up

from .graphs import MAX_FRAMES, ROW_BUCKETS

if TYPE_CHECKING:
    from .hift import CausalHiFT

Shape = tuple[int, int, int]  # (rows, mel frames, windowed: 1, or 0 from frame 0) of a padded non-final call

FRAME_STEP = 16  # windowed buckets are multiples of this many mel frames
MAX_CHUNKS = 64  # chunk indices a schedule is walked for (hops that double pass MAX_FRAMES long before)


def window_calls(hift: "CausalHiFT", schedule: HopSchedule, token_mel_ratio: int, max_frames: int = MAX_FRAMES,
                 max_chunks: int = MAX_CHUNKS) -> list[tuple[bool, int]]:
    """Per chunk index of a stream cut by `schedule`, the non-final vocoder call its chunk makes (every non-final
    chunk of an index has the index's hop): windowed or from frame 0, and its mel frames, as
    `CausalHiFT.stream_chunks` forms it; while a chunk's new frames are at most `max_frames`. A chunk whose stream
    has no frame to vocode yet (all held back) makes no call and is left out."""
    held, spf = hift.config.held_back_frames, hift.config.samples_per_frame
    calls = []
    frames = sent = 0
    for index in range(max_chunks):
        new = token_mel_ratio * schedule.hop(index)
        if new > max_frames:
            break
        frames += new
        windowed, width = hift.window_frames(frames, sent)
        if windowed or frames > held:
            calls.append((windowed, width))
            sent = spf * (frames - held)
    return calls


@dataclass(frozen=True)
class WindowBuckets:
    """The padded shapes non-final vocoder calls replay from CUDA graphs: rows x mel frames of a windowed call
    (`windows`, left-padded up to the bucket), or exactly the mel frames of a call from frame 0 (`starts`)."""

    rows: tuple[int, ...] = ()
    windows: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()

    @classmethod
    def covering(cls, hift: "CausalHiFT", schedules: Iterable[HopSchedule], token_mel_ratio: int,
                 rows: Sequence[int] = ROW_BUCKETS, max_frames: int = MAX_FRAMES,
                 frame_step: int = FRAME_STEP) -> "WindowBuckets":
        """Buckets for every non-final call of streams cut by `schedules` (`window_calls`), of up to max(rows)
        rows."""
        windows, starts = set(), set()
        for schedule in schedules:
            for windowed, frames in window_calls(hift, schedule, token_mel_ratio, max_frames):
                if windowed:
                    windows.add(round_up(frames, frame_step))
                else:
                    starts.add(frames)
        return cls(tuple(sorted(set(rows))), tuple(sorted(windows)), tuple(sorted(starts)))

    def fit(self, rows: int, frames: int, windowed: bool) -> Optional[Shape]:
        """The bucket a non-final call is padded to, or None (it runs eagerly)."""
        if windowed:
            shape = fit((rows, frames), (self.rows, self.windows))
        else:
            shape = fit((rows,), (self.rows,)) if frames in self.starts else None
            shape = None if shape is None else (shape[0], frames)
        return None if shape is None else (shape[0], shape[1], int(windowed))

    def shapes(self) -> list[Shape]:
        """Every bucket, the largest first: a smaller capture then reuses the pool blocks a larger one freed."""
        shapes = [(rows, frames, 1) for rows in self.rows for frames in self.windows]
        shapes += [(rows, frames, 0) for rows in self.rows for frames in self.starts]
        return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)


class WindowGraphs(PaddedCallGraphs):
    """CUDA graphs of `CausalHiFT.window_pass` for non-final calls, one per bucket (`WindowBuckets`), on the
    vocoder's device. `bucket` gives the shape `stream_chunks` pads a call to (None: it runs eagerly, counted in
    `eager_calls` with the final calls), `replay` runs it. `emulate` (tests): pad and use the static buffers on any
    device, running each bucket's pass eagerly."""

    outputs = 2  # audio, phase sums

    def __init__(self, hift: "CausalHiFT", buckets: WindowBuckets = WindowBuckets()) -> None:
        super().__init__()
        self._hift = [hift]  # a list, so the module is not registered as a child
        self.buckets = buckets

    def bucket(self, rows: int, frames: int, windowed: bool, finalize: bool, device: torch.device) -> Optional[Shape]:
        """The bucket a call of `rows` rows of `frames` mel frames on `device` is padded to, or None: it runs
        eagerly (a final call, no bucket fits, or nothing captured there and not emulating)."""
        if finalize or not self.replays_on(device):
            return None
        return self.buckets.fit(rows, frames, windowed)

    def _layout(self, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
        """`window_pass`'s inputs (mel, noise, phases, pads), then its outputs (audio, phase sums)."""
        rows, frames, windowed = shape
        hift = self._hift[0]
        c = hift.config
        f0_frames = frames - (hift.f0_context if windowed else 0) - c.f0_lookahead
        samples = c.samples_per_frame * (f0_frames - c.conv_pre_look_right - 1)
        harmonics = c.num_harmonic_channels
        return {"mel": ((rows, c.in_channels, frames), dtype),
                "noise": ((rows, c.samples_per_frame * f0_frames, harmonics), dtype),
                "phases": ((rows, harmonics), torch.float64), "pads": ((rows,), torch.long),
                "audio": ((rows, samples), dtype), "sums": ((rows, f0_frames + 1, harmonics), torch.float64)}

    def _pass(self, shape: tuple[int, ...]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        hift, windowed = self._hift[0], bool(shape[2])
        return lambda mel, noise, phases, pads: hift.window_pass(mel, noise, phases, pads, windowed, finalize=False)
