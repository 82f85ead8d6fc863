"""Decoding and measuring audio the gateway returned (PyAV and numpy, no gateway code)."""

from __future__ import annotations

import io

import av
import numpy as np


def decode(data: bytes, response_format: str) -> tuple[np.ndarray, int]:
    """Mono float samples and their rate of one complete file (pcm: raw 24 kHz s16le)."""
    if response_format == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0, 24_000
    parts: list[np.ndarray] = []
    rate = 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            rate = frame.sample_rate
            parts.append(frame.to_ndarray().reshape(-1).astype(np.float32))  # all outputs are mono
    return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), rate


def duration(data: bytes, response_format: str) -> float:
    samples, rate = decode(data, response_format)
    return samples.size / rate


def dominant_frequency(samples: np.ndarray, rate: int) -> float:
    windowed = samples * np.hanning(samples.size)
    spectrum = np.abs(np.fft.rfft(windowed))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[int(np.argmax(spectrum))])


def decodable_seconds(prefix: bytes, response_format: str) -> float:
    """Seconds of audio in a possibly truncated file (0 when nothing decodes yet)."""
    if response_format == "pcm":
        return len(prefix) // 2 / 24_000
    try:
        samples, rate = _decode_prefix(prefix)
    except (av.FFmpegError, ValueError):
        return 0.0
    return samples / rate if rate else 0.0


def _decode_prefix(prefix: bytes) -> tuple[int, int]:
    count, rate = 0, 0
    with av.open(io.BytesIO(prefix)) as container:
        try:
            for frame in container.decode(audio=0):
                count += frame.samples
                rate = frame.sample_rate
        except (av.FFmpegError, EOFError):
            pass  # the truncated tail
    return count, rate


#: Every response format the gateway serves, and the rate each comes at (opus: 48 kHz, the rest 24 kHz).
FORMAT_RATES = {"mp3": 24_000, "opus": 48_000, "aac": 24_000, "flac": 24_000, "wav": 24_000, "pcm": 24_000}


def check_speech(data: bytes, response_format: str, whole: int) -> None:
    """One speech response of a real pipeline: audio at the format's rate, finite and not silent; a lossless one
    (pcm, wav, flac) of whole tokens, `whole` samples (at 24 kHz) each."""
    samples, rate = decode(data, response_format)
    assert rate == FORMAT_RATES[response_format]
    assert samples.size > 0 and np.isfinite(samples).all() and np.abs(samples).max() > 0
    if response_format in ("pcm", "wav", "flac"):
        assert samples.size % whole == 0
