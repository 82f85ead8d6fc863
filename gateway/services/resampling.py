"""Sample-rate conversion of a pipeline's waveform to the rate the gateway serves (`OUTPUT_SAMPLE_RATE`).

Pipelines state their rate in every response (the contract's `sample_rate`): CosyVoice2 already speaks at
24 kHz, Spark-TTS at 16 kHz. The conversion is FFmpeg's resampler (libswresample through PyAV), kept open
across a segment's chunks so that its filter state carries over: the streamed chunks concatenate to exactly
what the whole waveform converts to (no clicks at chunk boundaries), and `finish` flushes the filter's tail,
so a segment of n samples at 16 kHz becomes exactly 1.5 n samples at 24 kHz.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np


class StreamResampler:
    """One segment's samples from `source_rate` to `target_rate`, chunk by chunk (mono float32)."""

    def __init__(self, source_rate: int, target_rate: int) -> None:
        if source_rate <= 0 or target_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {source_rate} -> {target_rate}")
        self.source_rate = source_rate
        self.target_rate = target_rate
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=target_rate)
        self._pts = 0

    def push(self, samples: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(1, -1)
        if samples.size == 0:
            return np.zeros(0, np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="flt", layout="mono")
        frame.sample_rate = self.source_rate
        frame.time_base = Fraction(1, self.source_rate)
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return self._collect(self._resampler.resample(frame))

    def finish(self) -> np.ndarray:
        """The filter's remaining samples; the resampler is done afterwards."""
        return self._collect(self._resampler.resample(None))

    @staticmethod
    def _collect(frames: list[av.AudioFrame]) -> np.ndarray:
        if not frames:
            return np.zeros(0, np.float32)
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)
