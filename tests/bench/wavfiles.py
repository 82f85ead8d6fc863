"""Test audio files written with the stdlib, so decoding is tested independently of the writer."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


def write_wav(path: Path, seconds: float, rate: int = 24_000, channels: int = 2, freq: float = 220.0) -> Path:
    """A tone as 16-bit PCM WAV (stdlib writer, so decoding is tested independently of it)."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(tone[:, None], channels, axis=1).tobytes())
    return path
