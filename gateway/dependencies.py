"""``Annotated`` dependency aliases: routes declare what they need, the app state provides it."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from gateway.metrics import GatewayMetrics
from gateway.services.models import ModelCatalog
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


def get_model_catalog(request: Request) -> ModelCatalog:
    return request.app.state.models


def get_metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
SpeechServiceDep = Annotated[SpeechService, Depends(get_speech_service)]
VoiceLibraryDep = Annotated[VoiceLibrary, Depends(get_voice_library)]
TritonClientDep = Annotated[TritonClient, Depends(get_triton_client)]
ModelCatalogDep = Annotated[ModelCatalog, Depends(get_model_catalog)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]
