"""``GET /v1/audio/models``: the speech model ids, for clients that ask the audio API itself.

Open WebUI fills its TTS model menu from ``GET {base}/audio/models`` (``{"models": [{"id", ...}]}``)
when its base URL is not OpenAI's; ``/v1/models`` stays the OpenAI listing. docs/clients.md.
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.dependencies import ModelCatalogDep
from gateway.schemas import AudioModel, AudioModelList

router = APIRouter()


@router.get("/v1/audio/models")
async def list_audio_models(catalog: ModelCatalogDep) -> AudioModelList:
    return AudioModelList(models=[AudioModel(id=model, name=model) for model in await catalog.listed()])
