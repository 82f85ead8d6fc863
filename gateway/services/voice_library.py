"""VoiceLibrary: uploaded voices from validation to disk, registry and the server's prompt cache.

An upload is checked (name, transcript, audio), converted once to 16 kHz mono, stored (see
VoiceStore), registered, and then its voice prompt is computed through Triton with an empty
``target_text`` (the contract's warm-up rule) by every deployed model (CosyVoice2, and Spark-TTS and CosyVoice3
when loaded: each keeps its own voice cache), so the first speech request finds it cached. If Triton
cannot do that now the voice is kept anyway (``warm=false`` in the log, ``tts_voice_warmups_total
{outcome="failed"}``); the first speech request then computes the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import unicodedata
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from gateway.errors import ApiError, Conflict, Forbidden, InvalidRequest, VoiceNotFound
from gateway.metrics import GatewayMetrics
from gateway.services.models import ModelCatalog
from gateway.services.voice_store import NameTaken, VoiceExists, VoiceStore
from gateway.services.voices import Voice, VoiceRegistry, decode_to_reference, voice_id
from gateway.settings import OPENAI_VOICE_NAMES
from gateway.triton_client import SegmentRequest, TritonClient
from pipeline_contract import REFERENCE_SAMPLE_RATE

logger = logging.getLogger(__name__)

MIN_SECONDS = 1.0
MAX_SECONDS = 30.0
#: A clip whose RMS level is below this is treated as silence (normal speech is around -20 dBFS).
SILENCE_DBFS = -50.0
MAX_NAME_CHARS = 64
MAX_TRANSCRIPT_CHARS = 1000
MAX_CONSENT_CHARS = 256
#: Voice ids look like this; a name starting with it could be mistaken for an id.
RESERVED_NAME_PREFIX = "voice_"
_PATH_CHARACTERS = frozenset("/\\")

AUDIO_PARAM = "audio_sample"


@dataclass(frozen=True)
class VoiceUpload:
    """The fields of ``POST /v1/audio/voices`` as received (nothing validated yet)."""

    name: str | None
    transcript: str | None
    consent: str | None
    audio: BinaryIO | None
    audio_bytes: int


def _invalid(message: str, param: str, code: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def validate_name(raw: str | None) -> str:
    name = (raw or "").strip()
    if not name:
        raise _invalid("A voice needs a 'name'.", "name", "missing_required_parameter")
    if len(name) > MAX_NAME_CHARS:
        raise _invalid(f"The voice name is longer than {MAX_NAME_CHARS} characters.", "name", "string_above_max_length")
    if any(ch in _PATH_CHARACTERS or unicodedata.category(ch).startswith("C") for ch in name) or name in {".", ".."}:
        raise _invalid(
            "The voice name must not contain '/', '\\' or control characters.", "name", "invalid_voice_name"
        )
    if name.casefold().startswith(RESERVED_NAME_PREFIX):
        raise _invalid(
            f"Voice names starting with '{RESERVED_NAME_PREFIX}' are reserved for voice ids.",
            "name",
            "invalid_voice_name",
        )
    return name


def validate_transcript(raw: str | None) -> str:
    """The transcript, or "" for none (OpenAI's upload has no transcript): the voice is then spoken in
    CosyVoice2's cross-lingual mode, which needs no words; an exact transcript clones more closely."""
    transcript = (raw or "").strip()
    if len(transcript) > MAX_TRANSCRIPT_CHARS:
        raise _invalid(
            f"The transcript is longer than {MAX_TRANSCRIPT_CHARS} characters.", "transcript", "string_above_max_length"
        )
    return transcript


def validate_consent(raw: str | None) -> str | None:
    consent = (raw or "").strip() or None
    if consent is not None and len(consent) > MAX_CONSENT_CHARS:
        raise _invalid(
            f"The consent id is longer than {MAX_CONSENT_CHARS} characters.", "consent", "string_above_max_length"
        )
    return consent


def level_dbfs(samples: np.ndarray) -> float:
    rms = float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))
    return 20 * math.log10(rms) if rms > 0 else -math.inf


def decode_sample(audio: BinaryIO) -> np.ndarray:
    """The upload as 16 kHz mono, or the 400 that says what is wrong with it."""
    try:
        samples = decode_to_reference(audio, stop_after_seconds=MAX_SECONDS)
    except ValueError as exc:  # av.FFmpegError is one
        # FFmpeg's own words ("[Errno 1094995529] Invalid data ...: 'None'") mean nothing to a client.
        logger.info("voice upload not decodable: %s", exc)
        raise _invalid(
            "The audio sample could not be decoded as audio: send a complete, undamaged recording in a common "
            "format (wav, mp3, ogg/opus, flac, m4a/aac, webm).",
            AUDIO_PARAM,
            "invalid_audio",
        ) from exc
    seconds = samples.size / REFERENCE_SAMPLE_RATE
    if seconds < MIN_SECONDS:
        raise _invalid(
            f"The audio sample is {seconds:.2f} s long; at least {MIN_SECONDS:g} s are needed.",
            AUDIO_PARAM,
            "audio_too_short",
        )
    if seconds > MAX_SECONDS:
        raise _invalid(f"The audio sample is longer than {MAX_SECONDS:g} s.", AUDIO_PARAM, "audio_too_long")
    if level_dbfs(samples) < SILENCE_DBFS:
        raise _invalid(
            f"The audio sample is silent (level below {SILENCE_DBFS:g} dBFS).", AUDIO_PARAM, "audio_silent"
        )
    return samples


def _names(voice: Voice, key: str) -> bool:
    """Whether `key` is the voice's own name or id (not an alias of it)."""
    return key.casefold() in {voice.name.casefold(), voice.id.casefold()}


class VoiceLibrary:
    """Create, look up and delete voices; the registry it shares with SpeechService is the truth
    for speech requests, the store keeps uploads across restarts."""

    def __init__(
        self,
        registry: VoiceRegistry,
        store: VoiceStore,
        triton: TritonClient,
        metrics: GatewayMetrics,
        *,
        max_upload_bytes: int,
        warmup_timeout_s: float,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self._catalog = catalog  # which pipelines an upload warms (None: the default one only)
        self._registry = registry
        self._store = store
        self._triton = triton
        self._metrics = metrics
        self._max_upload_bytes = max_upload_bytes
        self._warmup_timeout_s = warmup_timeout_s
        # Serializes "is the name free? -> store -> register" across concurrent uploads and deletions.
        self._lock = asyncio.Lock()

    @property
    def voices(self) -> list[Voice]:
        return self._registry.voices

    @contextmanager
    def counting_rejections(self) -> Iterator[None]:
        """Count the client errors raised inside (by code) in ``tts_voice_upload_rejections_total``."""
        try:
            yield
        except ApiError as exc:
            if exc.status < 500:
                self._metrics.voice_upload_rejections.labels(exc.code or "unknown").inc()
            raise

    def get(self, key: str) -> Voice:
        voice = self._registry.find(key)
        if voice is None:
            raise VoiceNotFound(f"Voice '{key}' not found.", param="voice_id")
        return voice

    async def create(self, upload: VoiceUpload) -> Voice:
        name = validate_name(upload.name)
        transcript = validate_transcript(upload.transcript)
        consent = validate_consent(upload.consent)
        self._check_name_free(name)
        if upload.audio is None:
            raise _invalid(
                "Attach the recording as the 'audio_sample' file.", AUDIO_PARAM, "missing_required_parameter"
            )
        if upload.audio_bytes > self._max_upload_bytes:
            raise _invalid(
                f"The audio sample is larger than the limit of {self._max_upload_bytes} bytes.",
                AUDIO_PARAM,
                "file_too_large",
            )
        samples = await asyncio.to_thread(decode_sample, upload.audio)
        voice = Voice(
            id=voice_id(samples, transcript),
            name=name,
            transcript=transcript,
            samples=samples,
            created_at=int(time.time()),
            uploaded=True,
            consent=consent,
        )
        async with self._lock:
            self._check_name_free(name)  # again: another upload may have taken it meanwhile
            existing = self._registry.find(voice.id)
            if existing is not None:
                raise Conflict(
                    f"This audio sample and transcript are already the voice '{existing.name}' ({existing.id}).",
                    param=AUDIO_PARAM,
                    code="voice_already_exists",
                )
            try:
                await asyncio.to_thread(self._store.save, voice)
            except NameTaken as exc:  # another replica sharing the directory claimed it first
                raise self._name_taken(name, f"voice {exc.voice_id} has it" if exc.voice_id else None) from None
            except VoiceExists:
                raise Conflict(
                    "This audio sample and transcript are already a voice.",
                    param=AUDIO_PARAM,
                    code="voice_already_exists",
                ) from None
            self._registry.add(voice)
        self._metrics.voice_uploads.inc()
        warm = await self._warm(voice)
        logger.info(
            "voice uploaded id=%s name=%s seconds=%.2f bytes=%d warm=%s",
            voice.id, voice.name, voice.seconds, upload.audio_bytes, warm,
        )  # fmt: skip
        return voice

    async def delete(self, key: str) -> Voice:
        async with self._lock:
            voice = self.get(key)
            if not voice.uploaded:
                # Say it in the client's words: it asked for `key`, perhaps an alias of the voice.
                what = f"Voice '{voice.name}'"
                if not _names(voice, key):
                    what = f"'{key}' is an alias of voice '{voice.name}', which"
                raise Forbidden(
                    f"{what} ships with the deployment and cannot be deleted.",
                    param="voice_id",
                    code="voice_not_deletable",
                )
            await asyncio.to_thread(self._store.delete, voice.id)
            self._registry.remove(voice.id)
        self._metrics.voice_deletions.inc()
        logger.info("voice deleted id=%s name=%s", voice.id, voice.name)
        return voice

    def _check_name_free(self, name: str) -> None:
        taken = self._registry.find(name)
        if name.casefold() in OPENAI_VOICE_NAMES:
            alias = f", here an alias of voice '{taken.name}'" if taken is not None else ""
            raise self._name_taken(name, f"it is an OpenAI voice name{alias}")
        if taken is not None:
            holder = f"voice '{taken.name}' ({taken.id})"
            raise self._name_taken(name, holder if _names(taken, name) else f"it is an alias of {holder}")

    @staticmethod
    def _name_taken(name: str, why: str | None) -> Conflict:
        return Conflict(
            f"The voice name '{name}' is taken" + (f": {why}." if why else " (by another upload).")
            + " Choose another name.",
            param="name",
            code="voice_name_taken",
        )

    async def _warm(self, voice: Voice) -> bool:
        """Have every deployed pipeline compute and cache the voice's prompt now (empty target text); each model
        keeps its own voice cache (a CosyVoice2 prompt is neither a Spark-TTS nor a CosyVoice3 one)."""
        pipelines = await self._catalog.deployed() if self._catalog is not None else [None]
        warm = True
        for pipeline in pipelines:
            request = SegmentRequest(
                request_id=f"voice-warmup-{uuid.uuid4().hex}",
                voice_id=voice.id,
                reference_wav=voice.samples,
                reference_text=voice.transcript,
                target_text="",
            )
            try:
                await self._triton.synthesize_offline(request, timeout_s=self._warmup_timeout_s, pipeline=pipeline)
            except ApiError as exc:
                logger.warning("voice %s stored but not warmed (%s %s): %s", voice.id, exc.status, exc.code,
                               exc.message)
                self._metrics.voice_warmups.labels("failed").inc()
                warm = False
                continue
            self._metrics.voice_warmups.labels("ok").inc()
        return warm
