"""Uploaded voices on disk: ``<id>.wav`` (16 kHz mono float32, the exact samples the pipeline
gets) and ``<id>.json`` (metadata).

Files are named by the voice id (a content hash), never by the user's name, so names cannot
reach the file system. Every file is written to a temporary name, fsynced and renamed into place;
the metadata is written last and is the commit marker: a voice exists only when its ``.json``
does. A crash between the two writes leaves an orphan ``.wav`` that the next load removes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from gateway.services.voices import Voice, decode_to_reference, voice_id
from triton_repo.contract import REFERENCE_SAMPLE_RATE

logger = logging.getLogger(__name__)

_TEMP_PREFIX = ".tmp-"
_VOICE_ID = re.compile(r"voice_[0-9a-f]{24}")


def wav_bytes(samples: np.ndarray) -> bytes:
    """A float32 mono WAV file at the reference rate (lossless, so the id stays reproducible)."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=REFERENCE_SAMPLE_RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = REFERENCE_SAMPLE_RATE
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


@dataclass(frozen=True)
class VoiceStore:
    directory: Path

    def _paths(self, voice_id: str) -> tuple[Path, Path]:
        return self.directory / f"{voice_id}.wav", self.directory / f"{voice_id}.json"

    # Writing -------------------------------------------------------------------------------------
    def save(self, voice: Voice) -> None:
        """Persist an uploaded voice: audio first, then the metadata that commits it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        audio_path, metadata_path = self._paths(voice.id)
        self._write_atomically(audio_path, wav_bytes(voice.samples))
        metadata = {
            "id": voice.id,
            "name": voice.name,
            "transcript": voice.transcript,
            "created_at": voice.created_at,
            "consent": voice.consent,
            "sample_rate": REFERENCE_SAMPLE_RATE,
            "samples": int(voice.samples.size),
        }
        try:
            self._commit(metadata_path, json.dumps(metadata, ensure_ascii=False, indent=1).encode())
        except BaseException:
            audio_path.unlink(missing_ok=True)  # a failed (not crashed) upload cleans up at once
            raise

    def _commit(self, metadata_path: Path, content: bytes) -> None:
        self._write_atomically(metadata_path, content)

    def delete(self, voice_id: str) -> None:
        """Remove the commit marker first: a crash half-way leaves an orphan, never half a voice."""
        audio_path, metadata_path = self._paths(voice_id)
        metadata_path.unlink(missing_ok=True)
        audio_path.unlink(missing_ok=True)
        self._sync_directory()

    def _write_atomically(self, path: Path, content: bytes) -> None:
        fd, temp_name = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=path.suffix, dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(content)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp_name, path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        self._sync_directory()

    def _sync_directory(self) -> None:
        """Make renames and unlinks durable (the directory entry is what a crash would lose)."""
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # Reading -------------------------------------------------------------------------------------
    def load(self) -> list[Voice]:
        """Every committed voice; leftovers of interrupted writes are removed, damaged voices skipped."""
        if not self.directory.is_dir():
            return []
        for leftover in self.directory.glob(f"{_TEMP_PREFIX}*"):
            logger.warning("removing unfinished voice file %s", leftover.name)
            leftover.unlink(missing_ok=True)
        for orphan in self.directory.glob("*.wav"):
            if not orphan.with_suffix(".json").exists():
                logger.warning("removing voice audio %s without metadata (interrupted upload)", orphan.name)
                orphan.unlink(missing_ok=True)
        voices = []
        for metadata_path in sorted(self.directory.glob("*.json")):
            try:
                voices.append(self._read(metadata_path))
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("uploaded voice %s skipped: %s", metadata_path.name, exc)
        logger.info("loaded %d uploaded voices from %s", len(voices), self.directory)
        return voices

    def find(self, key: str) -> Voice | None:
        """A committed voice by id or case-insensitive name, read from disk now (None if there is none).

        For gateway replicas sharing this directory: a voice another replica stored after this one loaded.
        Ids name their file directly; names need a look at each metadata file.
        """
        if not self.directory.is_dir():
            return None
        if _VOICE_ID.fullmatch(key):
            candidates = [self.directory / f"{key}.json"]
        else:
            candidates = sorted(self.directory.glob("*.json"))
        for metadata_path in candidates:
            try:
                metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
                if metadata.get("id") == key or str(metadata.get("name", "")).casefold() == key.casefold():
                    return self._read(metadata_path)
            except (OSError, ValueError, KeyError):
                continue  # absent, half-written or damaged: not a voice (yet)
        return None

    def _read(self, metadata_path: Path) -> Voice:
        metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
        samples = decode_to_reference(metadata_path.with_suffix(".wav"))
        if voice_id(samples, metadata["transcript"]) != metadata["id"] or metadata_path.stem != metadata["id"]:
            raise ValueError("audio or transcript do not match the voice id")
        return Voice(
            id=metadata["id"],
            name=metadata["name"],
            transcript=metadata["transcript"],
            samples=samples,
            created_at=int(metadata["created_at"]),
            uploaded=True,
            consent=metadata.get("consent"),
        )
