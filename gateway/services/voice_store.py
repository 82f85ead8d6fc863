"""Uploaded voices on disk: ``<id>.wav`` (16 kHz mono float32, the exact samples the pipeline
gets) and ``<id>.json`` (metadata).

Files are named by the voice id (a content hash), never by the user's name, so names cannot
reach the file system. Every file is written to a temporary name, fsynced and renamed into place;
the metadata is written last and is the commit marker: a voice exists only when its ``.json``
does. A crash between the two writes leaves an orphan ``.wav`` that the next load removes.

Several gateway replicas may share the directory. Names are claimed with an atomic
create-exclusive: the commit hard-links the finished metadata file first to
``.names/<hash of the case-folded name>`` and then to ``<id>.json``; ``link`` fails if the target
exists, so of two replicas committing one name (or one voice) exactly one wins, whatever their
in-memory registries believed. A claim without its voice (a crash between the two links) is stale
after ``STALE_CLAIM_S`` and removed.
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

import hashlib
import time

import av
import numpy as np

from gateway.services.voices import Voice, decode_to_reference, voice_id
from pipeline_contract import REFERENCE_SAMPLE_RATE

logger = logging.getLogger(__name__)

_TEMP_PREFIX = ".tmp-"
_VOICE_ID = re.compile(r"voice_[0-9a-f]{24}")

_NAMES_DIR = ".names"
#: A name claim whose voice metadata is missing this long is a crash leftover, not a commit in progress
#: (the two links of a commit are microseconds apart).
STALE_CLAIM_S = 10.0


class NameTaken(Exception):
    """Another voice (possibly committed by another replica) holds the name."""

    def __init__(self, voice_id: str) -> None:
        super().__init__(voice_id)
        self.voice_id = voice_id


class VoiceExists(Exception):
    """The same voice (same id: audio and transcript) is already stored."""


def name_key(name: str) -> str:
    """The claim file name of a voice name: case-insensitive, and no user text in the file system."""
    return hashlib.sha256(name.casefold().encode("utf-8")).hexdigest()[:32]


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


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


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
            if not metadata_path.exists():  # else the audio is the same voice's, committed by another replica
                audio_path.unlink(missing_ok=True)  # a failed (not crashed) upload cleans up at once
            raise

    def _commit(self, metadata_path: Path, content: bytes) -> None:
        """Claim the name, then publish the metadata, both create-exclusive (see the module doc)."""
        metadata = json.loads(content)
        names = self.directory / _NAMES_DIR
        names.mkdir(exist_ok=True)
        claim = names / name_key(metadata["name"])
        fd, temp_name = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".json", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(content)
                file.flush()
                os.fsync(file.fileno())
            self._claim(claim, Path(temp_name))
            try:
                os.link(temp_name, metadata_path)
            except FileExistsError:
                claim.unlink(missing_ok=True)
                raise VoiceExists(metadata["id"]) from None
        finally:
            Path(temp_name).unlink(missing_ok=True)
        self._sync_directory(names)
        self._sync_directory()

    def _claim(self, claim: Path, source: Path) -> None:
        for _ in range(2):
            try:
                os.link(source, claim)
                return
            except FileExistsError:
                holder = self._claim_holder(claim)
                if holder is not None:
                    raise NameTaken(holder) from None
                claim.unlink(missing_ok=True)  # stale: retry once
        raise NameTaken("")  # another replica re-claimed it meanwhile

    def _claim_holder(self, claim: Path) -> str | None:
        """The voice id holding a claim, or None when the claim is a stale leftover."""
        try:
            holder = json.loads(claim.read_text(encoding="utf-8"))["id"]
            age = time.time() - claim.stat().st_mtime
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError):
            return ""  # unreadable: respect it rather than take the name
        if (self.directory / f"{holder}.json").exists() or age < STALE_CLAIM_S:
            return holder
        return None

    def delete(self, voice_id: str) -> None:
        """Remove the commit marker first: a crash half-way leaves an orphan, never half a voice.
        The name claim goes last, so the name is never free while the voice still exists."""
        audio_path, metadata_path = self._paths(voice_id)
        try:
            name = json.loads(metadata_path.read_text(encoding="utf-8"))["name"]
        except (OSError, ValueError, KeyError):
            name = None
        metadata_path.unlink(missing_ok=True)
        audio_path.unlink(missing_ok=True)
        self._sync_directory()
        if name is not None:
            claim = self.directory / _NAMES_DIR / name_key(name)
            if self._claim_holder(claim) in (voice_id, None):
                claim.unlink(missing_ok=True)

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

    def _sync_directory(self, directory: Path | None = None) -> None:
        """Make renames and unlinks durable (the directory entry is what a crash would lose)."""
        fd = os.open(directory or self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # Reading -------------------------------------------------------------------------------------
    def load(self) -> list[Voice]:
        """Every committed voice; leftovers of interrupted writes are removed, damaged voices skipped."""
        if not self.directory.is_dir():
            return []
        # Only old leftovers: a young one may be another replica's upload in progress.
        for leftover in self.directory.glob(f"{_TEMP_PREFIX}*"):
            if _age(leftover) > STALE_CLAIM_S:
                logger.warning("removing unfinished voice file %s", leftover.name)
                leftover.unlink(missing_ok=True)
        for orphan in self.directory.glob("*.wav"):
            if not orphan.with_suffix(".json").exists() and _age(orphan) > STALE_CLAIM_S:
                logger.warning("removing voice audio %s without metadata (interrupted upload)", orphan.name)
                orphan.unlink(missing_ok=True)
        for claim in self.directory.glob(f"{_NAMES_DIR}/*"):
            if self._claim_holder(claim) is None:
                logger.warning("removing the stale name claim %s (interrupted upload)", claim.name)
                claim.unlink(missing_ok=True)
        voices = []
        for voice_id in sorted(self.committed_ids()):
            try:
                voices.append(self.read(voice_id))
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("uploaded voice %s skipped: %s", voice_id, exc)
        logger.info("loaded %d uploaded voices from %s", len(voices), self.directory)
        # Oldest first: should two voices share a name (written before names were claimed), every
        # replica gives the name to the same one.
        return sorted(voices, key=lambda v: (v.created_at, v.id))

    def committed_ids(self) -> set[str]:
        """Ids of the voices committed in the directory now (by any replica)."""
        try:
            with os.scandir(self.directory) as entries:
                return {
                    e.name[: -len(".json")]
                    for e in entries
                    if e.name.endswith(".json") and not e.name.startswith(".")
                }
        except FileNotFoundError:
            return set()

    def read(self, voice_id: str) -> Voice:
        """One committed voice. Raises OSError (e.g. deleted meanwhile), ValueError or KeyError (damaged)."""
        return self._read(self.directory / f"{voice_id}.json")

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
