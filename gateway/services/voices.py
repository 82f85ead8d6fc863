"""Reference voices for zero-shot cloning: loaded once at startup, converted once to 16 kHz mono."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from gateway.errors import VoiceNotFound
from triton_repo.contract import REFERENCE_SAMPLE_RATE

logger = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm")


@dataclass(frozen=True)
class Voice:
    """One reference voice: what the pipeline needs to clone it."""

    id: str  # content hash of audio + transcript: the pipeline's prompt-cache key
    name: str
    transcript: str
    samples: np.ndarray  # float32, 16 kHz mono

    @property
    def seconds(self) -> float:
        return self.samples.size / REFERENCE_SAMPLE_RATE


def decode_to_reference(path: Path) -> np.ndarray:
    """Decode any audio file FFmpeg reads and resample it to 16 kHz mono float32."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=REFERENCE_SAMPLE_RATE)
    parts: list[np.ndarray] = []
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
    parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    if not parts:
        raise ValueError(f"{path}: no audio")
    return np.concatenate(parts).astype(np.float32, copy=False)


def voice_id(samples: np.ndarray, transcript: str) -> str:
    digest = hashlib.sha256(samples.tobytes() + b"\0" + transcript.encode()).hexdigest()
    return f"voice_{digest[:24]}"


def load_voice(audio_path: Path) -> Voice:
    transcript = audio_path.with_suffix(".txt").read_text(encoding="utf-8").strip()
    if not transcript:
        raise ValueError(f"{audio_path.with_suffix('.txt')}: empty transcript")
    samples = decode_to_reference(audio_path)
    return Voice(id=voice_id(samples, transcript), name=audio_path.stem, transcript=transcript, samples=samples)


class VoiceRegistry:
    """Voices by name and by id, plus OpenAI voice names as aliases of shipped voices."""

    def __init__(self, voices: list[Voice], aliases: dict[str, str] | None = None) -> None:
        self._by_key: dict[str, Voice] = {}
        self._voices = sorted(voices, key=lambda v: v.name)
        for voice in self._voices:
            self._by_key[voice.name] = voice
            self._by_key[voice.id] = voice
        for alias, target in (aliases or {}).items():
            if target in self._by_key and alias not in self._by_key:
                self._by_key[alias] = self._by_key[target]
            elif target not in self._by_key:
                logger.warning("voice alias %r points to unknown voice %r", alias, target)

    @classmethod
    def from_directory(cls, directory: Path, aliases: dict[str, str] | None = None) -> VoiceRegistry:
        """Every ``<name>.<audio>`` with a ``<name>.txt`` transcript next to it; bad files are skipped."""
        voices: list[Voice] = []
        for path in sorted(directory.glob("*")) if directory.is_dir() else []:
            if path.suffix.lower() not in AUDIO_SUFFIXES:
                continue
            if not path.with_suffix(".txt").exists():
                logger.warning("voice %s skipped: no transcript %s", path.name, path.with_suffix(".txt").name)
                continue
            try:
                voices.append(load_voice(path))
            except (OSError, ValueError, av.FFmpegError) as exc:
                logger.warning("voice %s skipped: %s", path.name, exc)
        logger.info("loaded %d voices from %s", len(voices), directory)
        return cls(voices, aliases)

    @property
    def voices(self) -> list[Voice]:
        return list(self._voices)

    def resolve(self, key: str) -> Voice:
        voice = self._by_key.get(key) or self._by_key.get(key.lower())
        if voice is None:
            raise VoiceNotFound(
                f"Voice '{key}' not found. GET /v1/audio/voices lists the available voices.", param="voice"
            )
        return voice
