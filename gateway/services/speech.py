"""SpeechService: one OpenAI speech request -> segments -> Triton requests -> encoded audio bytes."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace

import numpy as np

from gateway.errors import ApiError, InvalidRequest, ModelNotFound, SynthesisFailed, TooManyRequests
from gateway.metrics import GatewayMetrics
from gateway.schemas import Caption, CaptionedSpeech, ResponseFormat, SpeechRequest, Usage
from gateway.services.audio_encoding import MEDIA_TYPES, create_encoder
from gateway.services.models import ModelCatalog
from gateway.services.resampling import StreamResampler
from gateway.services.voices import Voice, VoiceRegistry
from gateway.settings import Settings
from gateway.triton_client import Pipeline, SegmentRequest, TritonClient
from pipeline_contract import OUTPUT_SAMPLE_RATE, SpeechChunk

logger = logging.getLogger(__name__)

SSE_MEDIA_TYPE = "text/event-stream"
#: ``sample_rate`` is a common peer extension; every model is served at 24 kHz (Spark-TTS's 16 kHz is resampled).
SUPPORTED_SAMPLE_RATES = (OUTPUT_SAMPLE_RATE,)

Segmenter = Callable[[str], list[str]]


class InFlightSlot:
    def __init__(self, limiter: InFlightLimiter) -> None:
        self._limiter: InFlightLimiter | None = limiter

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter.release()
            self._limiter = None


class InFlightLimiter:
    """At most ``limit`` speech requests at a time; the next one is refused at once with 429."""

    def __init__(self, limit: int, retry_after_s: int, metrics: GatewayMetrics) -> None:
        self._limit = limit
        self._retry_after_s = retry_after_s
        self._metrics = metrics
        self._count = 0

    def acquire(self) -> InFlightSlot:
        if self._count >= self._limit:
            raise TooManyRequests(
                f"Too many speech requests in flight (limit {self._limit}); retry later.",
                retry_after=self._retry_after_s,
            )
        self._count += 1
        self._metrics.in_flight.set(self._count)
        return InFlightSlot(self)

    def release(self) -> None:
        self._count -= 1
        self._metrics.in_flight.set(self._count)


@dataclass
class SpeechPlan:
    """A validated request, ready to run."""

    request_id: str
    model: str
    voice: Voice
    segments: list[str]
    response_format: ResponseFormat
    speed: float
    seed: int | None
    stream: bool  # relay chunks as they come (streaming model) instead of one complete file
    sse: bool
    characters: int
    captions: bool = False  # speech.caption SSE events (docs/gateway.md#captions)
    instructions: str | None = None  # OpenAI's `instructions`, spoken in the model's instruct mode
    pipeline: Pipeline | None = None  # the Triton models of `model` (None: the default, CosyVoice2's)


@dataclass
class _Progress:
    """What one request did, for its log line, metrics and SSE usage."""

    started: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    samples: int = 0
    segment_ends: list[int] = field(default_factory=list)  # samples (24 kHz) at the end of each finished segment
    input_tokens: int = 0
    output_tokens: int = 0
    outcome: str = "ok"
    #: The server failed the request (a 5xx, an unexpected error), e.g. a stream cut by a Triton crash: logged
    #: as a warning, where an operator looks; a client's mistake or a client leaving stays an info line.
    server_failed: bool = False

    @property
    def audio_seconds(self) -> float:
        return self.samples / OUTPUT_SAMPLE_RATE

    def captions(self, segments: list[str], speed: float) -> list[Caption]:
        """The finished segments with exact times: sample counts at 24 kHz, scaled by 1/speed (atempo)."""
        rate = OUTPUT_SAMPLE_RATE * speed
        starts = [0, *self.segment_ends[:-1]]
        return [
            Caption(index=i, text=segments[i].strip(), start=start / rate, end=end / rate)
            for i, (start, end) in enumerate(zip(starts, self.segment_ends))
        ]

    def usage(self) -> Usage:
        return Usage(
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.input_tokens + self.output_tokens,
        )


class SpeechStream:
    """The response body: its first element was already produced (so errors at the start became
    proper HTTP errors); ``aclose()`` stops the synthesis and returns the in-flight slot."""

    def __init__(self, media_type: str, first: bytes, rest: AsyncIterator[bytes]) -> None:
        self.media_type = media_type
        self._first: bytes | None = first
        self._rest = rest

    def __aiter__(self) -> SpeechStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        await self._rest.aclose()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class CompleteSpeech:
    media_type: str
    content: bytes


class _OutputRate:
    """A segment's chunks at the gateway's rate (`OUTPUT_SAMPLE_RATE`): chunks at another rate go through one
    `StreamResampler`, whose tail comes out with the segment's final chunk."""

    def __init__(self) -> None:
        self._resampler: StreamResampler | None = None

    def __call__(self, chunk: SpeechChunk) -> SpeechChunk:
        if chunk.sample_rate == OUTPUT_SAMPLE_RATE and self._resampler is None:
            return chunk
        if self._resampler is None:
            self._resampler = StreamResampler(chunk.sample_rate, OUTPUT_SAMPLE_RATE)
        elif chunk.waveform.size and chunk.sample_rate != self._resampler.source_rate:
            raise SynthesisFailed(
                f"Synthesis failed: the stream changed its sample rate ({self._resampler.source_rate} -> "
                f"{chunk.sample_rate} Hz)."
            )
        samples = self._resampler.push(chunk.waveform)
        if chunk.final:
            samples = np.concatenate([samples, self._resampler.finish()])
        return replace(chunk, waveform=samples, sample_rate=OUTPUT_SAMPLE_RATE)


def _sse_event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SpeechService:
    def __init__(
        self,
        settings: Settings,
        voices: VoiceRegistry,
        triton: TritonClient,
        metrics: GatewayMetrics,
        segmenter: Segmenter,
        catalog: ModelCatalog | None = None,
    ) -> None:
        self._settings = settings
        self._catalog = catalog or ModelCatalog(settings, triton)
        self._voices = voices
        self._triton = triton
        self._metrics = metrics
        self._segmenter = segmenter
        self._limiter = InFlightLimiter(settings.max_in_flight, settings.retry_after_s, metrics)

    # Validation ----------------------------------------------------------------------------------
    def plan(self, request: SpeechRequest, request_id: str) -> SpeechPlan:
        """Everything that can be refused before synthesis starts (beyond the schema)."""
        if not self._catalog.is_known(request.model):
            raise ModelNotFound(f"The model '{request.model}' does not exist.", param="model")
        instructions = (request.instructions or "").strip() or None
        if instructions is not None:
            self._catalog.check_instructions(request.model)
        sample_rate = (request.model_extra or {}).get("sample_rate")
        if sample_rate is not None and sample_rate not in SUPPORTED_SAMPLE_RATES:
            raise InvalidRequest(
                f"sample_rate {sample_rate} is not supported; the output is {OUTPUT_SAMPLE_RATE} Hz.",
                param="sample_rate",
                code="unsupported_value",
            )
        if request.captions and request.stream_format != "sse":
            raise InvalidRequest(
                "captions are sent as SSE events: use stream_format 'sse', or POST /v1/audio/speech/captioned "
                "for the complete file with its captions.",
                param="captions",
                code="unsupported_value",
            )
        voice = self._voices.resolve(request.voice_key)
        segments = self._segmenter(request.input)
        if not segments:
            raise InvalidRequest(
                "The input contains nothing to speak: it needs at least one letter or number "
                "(punctuation, symbols and emoji alone are not spoken).",
                param="input",
            )
        sse = request.stream_format == "sse"
        stream = sse or (self._settings.stream_by_default if request.stream is None else request.stream)
        return SpeechPlan(
            request_id=request_id,
            model=request.model,
            voice=voice,
            segments=segments,
            response_format=request.response_format,
            speed=request.speed,
            seed=request.seed,
            instructions=instructions,
            stream=stream,
            sse=sse,
            characters=len(request.input),
            captions=request.captions,
        )

    # Running -------------------------------------------------------------------------------------
    async def create_speech(self, request: SpeechRequest, request_id: str) -> SpeechStream | CompleteSpeech:
        """A primed SpeechStream when streaming, else the complete file.

        Raises ApiError for anything that goes wrong before the first audio chunk.
        """
        plan = self.plan(request, request_id)
        plan.pipeline = await self._catalog.resolve(plan.model)
        body = self._run(plan, self._limiter.acquire())
        media_type = SSE_MEDIA_TYPE if plan.sse else MEDIA_TYPES[plan.response_format]
        try:
            first = await body.__anext__()
            if plan.stream:
                return SpeechStream(media_type, first, body)
            rest = [part async for part in body]
        except BaseException:
            await body.aclose()
            raise
        return CompleteSpeech(media_type, first + b"".join(rest))

    async def create_captioned(self, request: SpeechRequest, request_id: str) -> CaptionedSpeech:
        """The complete file (offline model, exact headers) with one caption per segment."""
        plain = request.model_copy(update={"captions": False, "stream_format": "audio"})  # the route's own mode
        plan = replace(self.plan(plain, request_id), stream=False, sse=False, captions=True)
        plan.pipeline = await self._catalog.resolve(plan.model)
        progress = _Progress()
        body = self._run(plan, self._limiter.acquire(), progress)
        try:
            audio = b"".join([part async for part in body])
        finally:
            await body.aclose()
        return CaptionedSpeech(
            audio=base64.b64encode(audio).decode(),
            response_format=plan.response_format,
            sample_rate=OUTPUT_SAMPLE_RATE,
            duration=progress.samples / (OUTPUT_SAMPLE_RATE * plan.speed),
            captions=progress.captions(plan.segments, plan.speed),
            usage=progress.usage(),
        )

    async def _run(
        self, plan: SpeechPlan, slot: InFlightSlot, progress: _Progress | None = None
    ) -> AsyncIterator[bytes]:
        """The encoded body; owns the in-flight slot, records metrics and the log line at the end."""
        progress = progress or _Progress()
        sent_any = False
        try:
            body = self._sse_body(plan, progress) if plan.sse else self._audio_body(plan, progress)
            async with aclosing(body) as parts:
                async for part in parts:
                    sent_any = True
                    yield part
        except ApiError as exc:
            progress.outcome = f"error {exc.status} {exc.code}"
            progress.server_failed = exc.status >= 500
            if sent_any:
                self._metrics.stream_failures.labels(plan.response_format).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            progress.outcome = "client disconnected"
            raise
        except Exception as exc:
            progress.outcome = f"error {type(exc).__name__}"
            progress.server_failed = True
            raise
        finally:
            slot.release()
            self._record(plan, progress)

    async def _audio_body(self, plan: SpeechPlan, progress: _Progress) -> AsyncIterator[bytes]:
        encoder = create_encoder(plan.response_format, streaming=plan.stream, speed=plan.speed)
        async with aclosing(self._chunks(plan, progress)) as chunks:
            async for chunk in chunks:
                yield encoder.encode(chunk.waveform)
        yield encoder.finish()

    async def _sse_body(self, plan: SpeechPlan, progress: _Progress) -> AsyncIterator[bytes]:
        encoder = create_encoder(plan.response_format, streaming=True, speed=plan.speed)

        def delta(data: bytes) -> bytes:
            return _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if data else b""

        sent_captions = 0

        def new_captions() -> bytes:
            """speech.caption events for the segments finished since the last call (opt-in)."""
            nonlocal sent_captions
            if not plan.captions:
                return b""
            fresh = progress.captions(plan.segments, plan.speed)[sent_captions:]
            sent_captions += len(fresh)
            return b"".join(_sse_event({"type": "speech.caption", **c.model_dump()}) for c in fresh)

        try:
            async with aclosing(self._chunks(plan, progress)) as chunks:
                async for chunk in chunks:
                    yield new_captions() + delta(encoder.encode(chunk.waveform))
            yield delta(encoder.finish()) + new_captions()
        except ApiError as exc:
            if progress.first_chunk_at is None:
                raise  # nothing sent yet: still a proper HTTP error
            self._metrics.stream_failures.labels(plan.response_format).inc()
            progress.outcome = f"error {exc.status} {exc.code} (sse event)"
            progress.server_failed = exc.status >= 500
            yield _sse_event({"type": "error", **exc.body()})
            return
        yield _sse_event({"type": "speech.audio.done", "usage": progress.usage().model_dump()})

    async def _chunks(self, plan: SpeechPlan, progress: _Progress) -> AsyncIterator[SpeechChunk]:
        """Pipeline chunks of all segments, one Triton request per segment, in order."""
        for index, text in enumerate(plan.segments):
            segment = SegmentRequest(
                request_id=f"{plan.request_id}-{index}",
                voice_id=plan.voice.id,
                reference_wav=plan.voice.samples,
                reference_text=plan.voice.transcript,
                target_text=text,
                seed=plan.seed,
                instruction=plan.instructions or "",
            )
            last: SpeechChunk | None = None
            to_output = _OutputRate()  # one per segment: its stream's filter state, flushed with its last chunk
            if plan.stream:
                async with aclosing(self._triton.synthesize_stream(segment, plan.pipeline)) as chunks:
                    async for chunk in chunks:
                        last = self._account(progress, to_output(chunk))
                        yield last
            else:
                chunk = await self._triton.synthesize_offline(segment, pipeline=plan.pipeline)
                last = self._account(progress, to_output(chunk))
                yield last
            if last is not None:  # usage outputs are cumulative per segment request
                progress.input_tokens += last.input_tokens
                progress.output_tokens += last.output_tokens
            progress.segment_ends.append(progress.samples)

    @staticmethod
    def _account(progress: _Progress, chunk: SpeechChunk) -> SpeechChunk:
        if progress.first_chunk_at is None:
            progress.first_chunk_at = time.monotonic()
        progress.samples += chunk.waveform.size
        return chunk

    def _record(self, plan: SpeechPlan, progress: _Progress) -> None:
        total = time.monotonic() - progress.started
        first_ms = (progress.first_chunk_at - progress.started) * 1000 if progress.first_chunk_at else None
        rtf = total / progress.audio_seconds if progress.audio_seconds else None
        if first_ms is not None:
            self._metrics.time_to_first_byte.observe(first_ms / 1000)
        if rtf is not None and progress.outcome == "ok":
            self._metrics.real_time_factor.observe(rtf)
        self._metrics.audio_seconds.inc(progress.audio_seconds)
        logger.log(
            logging.WARNING if progress.server_failed else logging.INFO,
            "speech request_id=%s model=%s voice=%s characters=%d segments=%d format=%s speed=%g stream=%s "
            "sse=%s first_byte_ms=%s total_ms=%.1f audio_s=%.3f rtf=%s tokens_in=%d tokens_out=%d outcome=%s",
            plan.request_id, plan.model, plan.voice.name, plan.characters, len(plan.segments),
            plan.response_format, plan.speed, plan.stream, plan.sse,
            f"{first_ms:.1f}" if first_ms is not None else "-", total * 1000, progress.audio_seconds,
            f"{rtf:.3f}" if rtf is not None else "-", progress.input_tokens, progress.output_tokens,
            progress.outcome,
        )  # fmt: skip
