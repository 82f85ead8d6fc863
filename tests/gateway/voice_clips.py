"""Reference clips for voice-upload tests, made at test time: a synthetic voiced signal (a 150 Hz
harmonic series with a syllable-like loudness envelope) encoded by PyAV in the upload formats."""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import httpx
import numpy as np

FUNDAMENTAL_HZ = 150.0


@dataclass(frozen=True)
class ClipFormat:
    """One upload format: a file suffix and how PyAV writes it."""

    suffix: str
    container: str
    codec: str
    rate: int
    channels: int
    content_type: str


#: Every accepted upload format, at assorted rates and channel counts.
CLIP_FORMATS = {
    "wav": ClipFormat("wav", "wav", "pcm_s16le", 44_100, 2, "audio/wav"),
    "mp3": ClipFormat("mp3", "mp3", "libmp3lame", 44_100, 2, "audio/mpeg"),
    "ogg": ClipFormat("ogg", "ogg", "libopus", 48_000, 1, "audio/ogg"),
    "flac": ClipFormat("flac", "flac", "flac", 8_000, 1, "audio/flac"),
    "m4a": ClipFormat("m4a", "ipod", "aac", 22_050, 2, "audio/mp4"),
    "aac": ClipFormat("aac", "adts", "aac", 16_000, 1, "audio/aac"),
    "webm": ClipFormat("webm", "webm", "libopus", 8_000, 1, "audio/webm"),
}


def voiced_signal(rate: int, seconds: float, *, level: float = 0.3, fundamental: float = FUNDAMENTAL_HZ) -> np.ndarray:
    """Mono float32 in [-level, level]: harmonics 1..7 at 1/k, loudness pulsing 4 times a second."""
    t = np.arange(int(rate * seconds)) / rate
    harmonics = sum(np.sin(2 * np.pi * k * fundamental * t) / k for k in range(1, 8) if k * fundamental < rate / 2)
    envelope = 0.35 + 0.65 * np.sin(np.pi * 4 * t) ** 2
    signal = harmonics * envelope
    return (level * signal / np.abs(signal).max()).astype(np.float32)


def encode_clip(samples: np.ndarray, clip: ClipFormat) -> bytes:
    """``samples`` (mono, at ``clip.rate``) as a file of that format, copied to every channel."""
    layout = "stereo" if clip.channels == 2 else "mono"
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=clip.container) as container:
        stream = container.add_stream(clip.codec, rate=clip.rate, layout=layout)
        planar = np.ascontiguousarray(np.repeat(samples[None, :], clip.channels, axis=0))
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
        frame.sample_rate = clip.rate
        context = stream.codec_context
        resampler = av.AudioResampler(
            format=context.format.name, layout=layout, rate=clip.rate, frame_size=context.frame_size or None
        )
        for part in resampler.resample(frame) + resampler.resample(None):
            container.mux(stream.encode(part))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def make_clip(fmt: str = "wav", seconds: float = 2.0, **signal: float) -> bytes:
    clip = CLIP_FORMATS[fmt]
    return encode_clip(voiced_signal(clip.rate, seconds, **signal), clip)


def upload(
    http: httpx.Client,
    *,
    name: str | None,
    audio: bytes | None,
    transcript: str | None = "The exact words spoken in the clip.",
    filename: str = "sample.wav",
    content_type: str = "audio/wav",
    **fields: str,
) -> httpx.Response:
    """``POST /v1/audio/voices`` as a multipart form (fields that are None are left out)."""
    text_fields = {"name": name, "transcript": transcript, **fields}
    # (None, value) is a plain form field, so the body is multipart even without a file.
    parts: dict[str, tuple[str | None, bytes | str] | tuple[str, bytes, str]] = {
        key: (None, value) for key, value in text_fields.items() if value is not None
    }
    if audio is not None:
        parts["audio_sample"] = (filename, audio, content_type)
    return http.post("/v1/audio/voices", files=parts)
