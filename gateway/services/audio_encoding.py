"""Streaming audio encoders: 24 kHz mono float32 chunks in, bytes of ONE file out.

Every format is one continuous encoder per request (never concatenated finished files). Compressed
formats go through PyAV (FFmpeg's encoders and muxers); wav and pcm are plain s16le samples behind
a RIFF header or none. ``speed`` runs FFmpeg's pitch-preserving ``atempo`` filter before encoding.
"""

from __future__ import annotations

import io
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction

import av
import av.filter
import numpy as np

from gateway.schemas import ResponseFormat
from pipeline_contract import OUTPUT_SAMPLE_RATE

MEDIA_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

#: atempo keeps its best quality inside [0.5, 2.0]; larger factors are chained stages.
_ATEMPO_MIN, _ATEMPO_MAX = 0.5, 2.0


def atempo_stages(speed: float) -> list[float]:
    """Split ``speed`` into atempo factors within [0.5, 2.0] whose product is ``speed``."""
    stages: list[float] = []
    rest = speed
    while rest > _ATEMPO_MAX:
        stages.append(_ATEMPO_MAX)
        rest /= _ATEMPO_MAX
    while rest < _ATEMPO_MIN:
        stages.append(_ATEMPO_MIN)
        rest /= _ATEMPO_MIN
    stages.append(rest)
    return stages


def _frame(samples: np.ndarray, pts: int) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
    frame.sample_rate = OUTPUT_SAMPLE_RATE
    frame.time_base = Fraction(1, OUTPUT_SAMPLE_RATE)
    frame.pts = pts
    return frame


class TempoFilter:
    """Pitch-preserving time stretch with FFmpeg's ``atempo`` (chained for 0.25 and 4.0)."""

    def __init__(self, speed: float) -> None:
        self._graph = av.filter.Graph()
        src = self._graph.add_abuffer(
            format="flt", sample_rate=OUTPUT_SAMPLE_RATE, layout="mono", time_base=Fraction(1, OUTPUT_SAMPLE_RATE)
        )
        node = src
        for factor in atempo_stages(speed):
            stage = self._graph.add("atempo", f"{factor:.6f}")
            node.link_to(stage)
            node = stage
        sink = self._graph.add("abuffersink")
        node.link_to(sink)
        self._graph.configure()
        self._pts = 0

    def process(self, samples: np.ndarray) -> np.ndarray:
        if samples.size:
            self._graph.push(_frame(samples, self._pts))
            self._pts += samples.size
        return self._drain()

    def flush(self) -> np.ndarray:
        self._graph.push(None)
        return self._drain()

    def _drain(self) -> np.ndarray:
        out: list[np.ndarray] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def to_s16le(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class AudioEncoder(ABC):
    """Feed float32 24 kHz mono chunks; get back the bytes that are ready (possibly none)."""

    media_type: str

    @abstractmethod
    def encode(self, samples: np.ndarray) -> bytes: ...

    @abstractmethod
    def finish(self) -> bytes:
        """Flush the encoder and the container; the concatenation of all returned bytes is the file."""


class PcmEncoder(AudioEncoder):
    media_type = MEDIA_TYPES["pcm"]

    def encode(self, samples: np.ndarray) -> bytes:
        return to_s16le(samples)

    def finish(self) -> bytes:
        return b""


def wav_header(data_bytes: int | None) -> bytes:
    """The 44-byte RIFF/WAVE header; unknown size (streaming) is written as 0xFFFFFFFF like OpenAI."""
    data_size = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff_size = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    byte_rate = OUTPUT_SAMPLE_RATE * 2
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff_size, b"WAVE", b"fmt ", 16, 1, 1, OUTPUT_SAMPLE_RATE, byte_rate, 2, 16, b"data", data_size,
    )  # fmt: skip


class WavEncoder(AudioEncoder):
    """Streaming: header first with 0xFFFFFFFF sizes. Complete file: header with the real sizes."""

    media_type = MEDIA_TYPES["wav"]

    def __init__(self, streaming: bool) -> None:
        self._streaming = streaming
        self._header_sent = False
        self._held = bytearray()  # complete-file mode: data until the size is known

    def encode(self, samples: np.ndarray) -> bytes:
        data = to_s16le(samples)
        if not self._streaming:
            self._held += data
            return b""
        if self._header_sent:
            return data
        self._header_sent = True
        return wav_header(None) + data

    def finish(self) -> bytes:
        if self._streaming:
            return b"" if self._header_sent else wav_header(None)
        return wav_header(len(self._held)) + bytes(self._held)


class _Sink:
    """A write-only, non-seekable file for the muxer: what it writes is taken out after each call."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


@dataclass(frozen=True)
class _Codec:
    container: str
    codec: str
    bit_rate: int | None = None


_CODECS: dict[str, _Codec] = {
    "mp3": _Codec("mp3", "libmp3lame", 64_000),
    "opus": _Codec("ogg", "libopus", 48_000),
    "aac": _Codec("adts", "aac", 64_000),
    "flac": _Codec("flac", "flac"),
}

# Streaming muxers must hand bytes out per packet: flush the I/O buffer after each packet, Ogg pages
# at most 100 ms long; an MP3 stream gets no Xing/LAME header (it would claim a wrong duration).
_STREAMING_CONTAINER_OPTIONS = {"flush_packets": "1"}
_STREAMING_FORMAT_OPTIONS = {"ogg": {"page_duration": "100000"}, "mp3": {"write_xing": "0"}}


class PyAVEncoder(AudioEncoder):
    """mp3, opus (Ogg), aac (ADTS) and flac through FFmpeg.

    Streaming writes to a non-seekable sink, so headers that are normally patched at the end
    (e.g. FLAC's total-samples) stay "unknown"; a complete file is written seekable and exact.
    """

    def __init__(self, response_format: str, streaming: bool) -> None:
        spec = _CODECS[response_format]
        self.media_type = MEDIA_TYPES[response_format]
        self._streaming = streaming
        self._file: _Sink | io.BytesIO = _Sink() if streaming else io.BytesIO()
        options = _STREAMING_FORMAT_OPTIONS.get(spec.container, {}) if streaming else {}
        self._container = av.open(
            self._file,
            mode="w",
            format=spec.container,
            options=options,
            container_options=_STREAMING_CONTAINER_OPTIONS if streaming else {},
        )
        self._stream = self._container.add_stream(spec.codec, rate=OUTPUT_SAMPLE_RATE, layout="mono")
        if spec.bit_rate:
            self._stream.bit_rate = spec.bit_rate
        self._pts = 0

    def encode(self, samples: np.ndarray) -> bytes:
        if samples.size:
            frame = _frame(samples, self._pts)
            self._pts += samples.size
            self._container.mux(self._stream.encode(frame))
        return self._take()

    def finish(self) -> bytes:
        self._container.mux(self._stream.encode(None))
        self._container.close()
        if isinstance(self._file, io.BytesIO):
            return self._file.getvalue()
        return self._file.take()

    def _take(self) -> bytes:
        return self._file.take() if isinstance(self._file, _Sink) else b""


class SpeedAdjusted(AudioEncoder):
    """Time-stretches the samples before handing them to the wrapped encoder."""

    def __init__(self, inner: AudioEncoder, speed: float) -> None:
        self.media_type = inner.media_type
        self._inner = inner
        self._tempo = TempoFilter(speed)

    def encode(self, samples: np.ndarray) -> bytes:
        return self._inner.encode(self._tempo.process(samples))

    def finish(self) -> bytes:
        return self._inner.encode(self._tempo.flush()) + self._inner.finish()


def create_encoder(response_format: ResponseFormat, *, streaming: bool, speed: float = 1.0) -> AudioEncoder:
    encoder: AudioEncoder
    if response_format == "pcm":
        encoder = PcmEncoder()
    elif response_format == "wav":
        encoder = WavEncoder(streaming)
    else:
        encoder = PyAVEncoder(response_format, streaming)
    return encoder if speed == 1.0 else SpeedAdjusted(encoder, speed)
