"""``create_app(settings)``: the FastAPI application with its services wired in."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.demo import DemoLabel, banner
from gateway.errors import install_error_handlers
from gateway.guard import Drain, RequestGuard
from gateway.metrics import GatewayMetrics
from gateway.routes import audio_models, captions, health, models, playground, speech, voices
from gateway.services.models import ModelCatalog
from gateway.services.speech import SpeechService
from gateway.services.voice_library import VoiceLibrary
from gateway.services.voice_store import VoiceStore
from gateway.services.voices import VoiceRegistry
from gateway.settings import Settings
from gateway.triton_client import TritonClient
from speech_text.segment import approximate_token_count, pipeline_segments

logger = logging.getLogger(__name__)

SPEECH_PATH = "/v1/audio/speech"


class SpeechRequestCounter:
    """Counts speech requests by final HTTP status and response format (also those refused by
    validation before the route ran). A pure ASGI middleware so streaming and disconnects pass through."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != SPEECH_PATH:
            await self._app(scope, receive, send)
            return
        status = "499"  # the client left before a response started

        async def send_and_observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, send_and_observe)
        finally:
            response_format = scope.get("state", {}).get("response_format", "unknown")
            self._metrics.requests.labels(status, response_format).inc()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = GatewayMetrics()

    # CosyVoice2's own normalization + segmentation (the gateway has no tokenizer: merge lengths are
    # estimated), then cut so every segment is provably within the pipeline's token limit.
    segmenter = partial(pipeline_segments, max_tokens=settings.max_segment_tokens, token_count=approximate_token_count)
    drain = Drain()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = VoiceStore(settings.uploaded_voices_dir)
        registry = VoiceRegistry.from_directory(settings.voices_dir, settings.voice_aliases, store.load(), store)
        triton = TritonClient(
            settings.triton_url,
            settings.offline_model,
            settings.streaming_model,
            timeout_s=settings.request_timeout_s,
            retry_after_s=settings.retry_after_s,
            known_voices=settings.known_voices_per_model,
            metrics=metrics,
            balance=settings.triton_balance,
        )
        app.state.triton = triton
        app.state.models = ModelCatalog(settings, triton)
        app.state.speech_service = SpeechService(settings, registry, triton, metrics, segmenter, app.state.models)
        app.state.voice_library = VoiceLibrary(
            registry,
            store,
            triton,
            metrics,
            max_upload_bytes=settings.max_voice_upload_bytes,
            warmup_timeout_s=settings.voice_warmup_timeout_s,
            catalog=app.state.models,
        )
        logger.info("gateway ready to serve: triton=%s (%s) voices=%d", settings.triton_url, settings.triton_balance,
                    len(registry.voices))
        if settings.demo:
            logger.warning("\n%s", banner(settings.host, settings.port, with_api_key=bool(settings.api_keys)))
        try:
            yield
        finally:
            await triton.close()

    app = FastAPI(title="cosyvoice-serve gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.started_at = int(time.time())
    app.state.drain = drain
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(playground.router)  # a static page: no key (its own requests carry one)
    for router in (speech.router, voices.router, models.router, audio_models.router, captions.router):
        app.include_router(router)  # behind RequestGuard: drain, API key, body limit
    app.add_middleware(
        RequestGuard,
        drain=drain,
        api_keys=settings.api_keys,
        max_body_bytes=settings.max_request_bytes,
        retry_after_s=settings.retry_after_s,
    )
    app.add_middleware(SpeechRequestCounter, metrics=metrics)  # also counts the guard's refusals
    if settings.demo:
        app.add_middleware(DemoLabel)  # outermost: every response, refusals included, says it is the demo
    return app
