from __future__ import annotations

from fastapi import APIRouter

from gateway.dependencies import VoiceRegistryDep
from gateway.schemas import VoiceInfo, VoiceList

router = APIRouter()


@router.get("/v1/audio/voices")
async def list_voices(voices: VoiceRegistryDep) -> VoiceList:
    """The Kokoro/Open WebUI listing shape: ``{"voices": [{"id", "name"}]}``."""
    return VoiceList(voices=[VoiceInfo(id=v.id, name=v.name) for v in voices.voices])
