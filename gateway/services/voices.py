"""Reference voices for voice cloning, converted once to 16 kHz mono, and the registry that
finds them by name, id or alias (shipped voices from ``TTS_VOICES_DIR`` plus uploaded ones).

A voice with a transcript is cloned in CosyVoice2's zero-shot mode, one without (empty transcript)
in its cross-lingual mode (docs/gateway.md#voice-modes); the pipeline decides from the transcript."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import av
import numpy as np

from gateway.errors import UnknownVoice
from pipeline_contract import REFERENCE_SAMPLE_RATE

logger = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm")


@dataclass(frozen=True)
class Voice:
    """One reference voice: what the pipeline needs to clone it."""

    id: str  # content hash of audio + transcript: the pipeline's prompt-cache key
    name: str
    transcript: str  # "" = none: cross-lingual mode
    samples: np.ndarray  # float32, 16 kHz mono
    created_at: int = 0  # Unix seconds
    uploaded: bool = False  # uploaded through the API (deletable), else shipped with the deployment
    consent: str | None = None  # OpenAI's consent id, stored as given (not verified)

    @property
    def seconds(self) -> float:
        return self.samples.size / REFERENCE_SAMPLE_RATE


def decode_to_reference(source: Path | BinaryIO, *, stop_after_seconds: float | None = None) -> np.ndarray:
    """Decode any audio file FFmpeg reads and resample it to 16 kHz mono float32.

    With ``stop_after_seconds`` decoding ends as soon as more than that was decoded, so a small
    but very long compressed file cannot expand without bound; the result is then truncated (and
    still longer than the limit, which is how callers see that it was too long).
    Raises ValueError (av.FFmpegError is one) for data that is not audio.
    """
    limit = None if stop_after_seconds is None else int(stop_after_seconds * REFERENCE_SAMPLE_RATE)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=REFERENCE_SAMPLE_RATE)
    parts: list[np.ndarray] = []
    decoded = 0
    with av.open(str(source) if isinstance(source, Path) else source, mode="r") as container:
        if not container.streams.audio:
            raise ValueError("no audio stream")
        for frame in container.decode(audio=0):
            for resampled in resampler.resample(frame):
                parts.append(resampled.to_ndarray().reshape(-1))
                decoded += parts[-1].size
            if limit is not None and decoded > limit:
                break
        else:
            parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    if not parts:
        raise ValueError("no audio")
    return np.concatenate(parts).astype(np.float32, copy=False)


def voice_id(samples: np.ndarray, transcript: str) -> str:
    digest = hashlib.sha256(samples.tobytes() + b"\0" + transcript.encode()).hexdigest()
    return f"voice_{digest[:24]}"


def load_voice(audio_path: Path) -> Voice:
    """``<name>.<audio>`` with its transcript from ``<name>.txt`` when that exists (else none)."""
    transcript_path = audio_path.with_suffix(".txt")
    transcript = transcript_path.read_text(encoding="utf-8").strip() if transcript_path.exists() else ""
    samples = decode_to_reference(audio_path)
    return Voice(
        id=voice_id(samples, transcript),
        name=audio_path.stem,
        transcript=transcript,
        samples=samples,
        created_at=int(audio_path.stat().st_mtime),
    )


def _key(name_or_id: str) -> str:
    return name_or_id.casefold()


class UploadSource(Protocol):
    """Where uploaded voices live (VoiceStore); other replicas may add and delete there."""

    def committed_ids(self) -> set[str]: ...

    def read(self, voice_id: str) -> Voice: ...


class VoiceRegistry:
    """Voices by name and by id (case-insensitive), plus aliases such as the OpenAI voice names.

    Shipped voices come first; an uploaded voice whose name was taken meanwhile (a shipped voice
    added later) stays reachable by its id. With an ``uploads`` source every lookup and listing
    first re-reads which uploaded voices exist there, so replicas sharing one directory agree.
    Mutated only from the event loop, so lookups need no lock.
    """

    def __init__(
        self, voices: list[Voice], aliases: dict[str, str] | None = None, uploads: UploadSource | None = None
    ) -> None:
        self._by_key: dict[str, Voice] = {}
        self._voices: list[Voice] = []
        self._uploads = uploads
        self._damaged: set[str] = set()  # ids that failed to load: not retried on every lookup
        for voice in voices:
            self.add(voice)
        for alias, target in (aliases or {}).items():
            if _key(target) in self._by_key and _key(alias) not in self._by_key:
                self._by_key[_key(alias)] = self._by_key[_key(target)]
            elif _key(target) not in self._by_key:
                logger.warning("voice alias %r points to unknown voice %r", alias, target)

    @classmethod
    def from_directory(
        cls,
        directory: Path,
        aliases: dict[str, str] | None = None,
        extra_voices: list[Voice] | None = None,
        uploads: UploadSource | None = None,
    ) -> VoiceRegistry:
        """Every ``<name>.<audio>``, with the ``<name>.txt`` transcript next to it if there is one (bad
        files are skipped), then ``extra_voices`` (the uploaded ones)."""
        voices: list[Voice] = []
        for path in sorted(directory.glob("*")) if directory.is_dir() else []:
            if path.suffix.lower() not in AUDIO_SUFFIXES:
                continue
            try:
                voices.append(load_voice(path))
            except (OSError, ValueError) as exc:
                logger.warning("voice %s skipped: %s", path.name, exc)
        logger.info("loaded %d voices from %s", len(voices), directory)
        return cls(voices + list(extra_voices or []), aliases, uploads)

    def refresh(self) -> None:
        """Follow the upload source: forget voices deleted there, add voices committed there."""
        if self._uploads is None:
            return
        on_disk = self._uploads.committed_ids()
        known = {voice.id for voice in self._voices if voice.uploaded}
        for gone in known - on_disk:
            self.remove(gone)
        new: list[Voice] = []
        for voice_id in on_disk - known - self._damaged:
            try:
                new.append(self._uploads.read(voice_id))
            except FileNotFoundError:
                continue  # deleted meanwhile
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("uploaded voice %s skipped: %s", voice_id, exc)
                self._damaged.add(voice_id)
        for voice in sorted(new, key=lambda v: (v.created_at, v.id)):  # the oldest keeps a shared name
            self.add(voice)

    @property
    def voices(self) -> list[Voice]:
        self.refresh()
        return sorted(self._voices, key=lambda v: (v.uploaded, v.name.casefold()))

    def find(self, key: str) -> Voice | None:
        """The voice a name, id or alias refers to."""
        self.refresh()
        return self._by_key.get(_key(key))

    def resolve(self, key: str) -> Voice:
        voice = self.find(key)
        if voice is None:
            raise UnknownVoice(
                f"Voice '{key}' not found. GET /v1/audio/voices lists the available voices.", param="voice"
            )
        return voice

    def add(self, voice: Voice) -> None:
        """Register a voice under its id and name; a name (or id) already taken keeps its voice."""
        if voice.uploaded and any(known.uploaded and known.id == voice.id for known in self._voices):
            return  # already found in the upload source
        self._voices.append(voice)
        for key in (voice.id, voice.name):
            if _key(key) in self._by_key:
                logger.warning("voice %s (%s): %r already refers to another voice", voice.name, voice.id, key)
            else:
                self._by_key[_key(key)] = voice

    def remove(self, voice_id: str) -> None:
        """Forget a voice under every key (id, name, aliases)."""
        self._voices = [voice for voice in self._voices if voice.id != voice_id]
        self._by_key = {key: voice for key, voice in self._by_key.items() if voice.id != voice_id}
