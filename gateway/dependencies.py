"""``Annotated`` dependency aliases: routes declare what they need, the app state provides it."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from gateway.errors import Unauthorized
from gateway.metrics import GatewayMetrics
from gateway.services.speech import SpeechService
from gateway.services.voice_library import VoiceLibrary
from gateway.settings import Settings
from gateway.triton_client import TritonClient


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_speech_service(request: Request) -> SpeechService:
    return request.app.state.speech_service


def get_voice_library(request: Request) -> VoiceLibrary:
    return request.app.state.voice_library


def get_triton_client(request: Request) -> TritonClient:
    return request.app.state.triton


def get_metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
SpeechServiceDep = Annotated[SpeechService, Depends(get_speech_service)]
VoiceLibraryDep = Annotated[VoiceLibrary, Depends(get_voice_library)]
TritonClientDep = Annotated[TritonClient, Depends(get_triton_client)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """Bearer auth on /v1/* when keys are configured (constant-time comparison)."""
    if not settings.api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized(
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer <key>'."
        )
    if not any(secrets.compare_digest(token.encode(), key.get_secret_value().encode()) for key in settings.api_keys):
        raise Unauthorized("Incorrect API key provided.")


ApiKeyDep = Depends(require_api_key)
