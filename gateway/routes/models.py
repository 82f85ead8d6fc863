from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.dependencies import ModelCatalogDep
from gateway.errors import ModelNotFound
from gateway.schemas import ModelCard, ModelList

router = APIRouter()

OWNER = "cosyvoice-serve"


def _card(request: Request, model_id: str) -> ModelCard:
    return ModelCard(id=model_id, created=request.app.state.started_at, owned_by=OWNER)


@router.get("/v1/models")
async def list_models(request: Request, catalog: ModelCatalogDep) -> ModelList:
    return ModelList(data=[_card(request, m) for m in await catalog.listed()])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, catalog: ModelCatalogDep) -> ModelCard:
    if model_id not in await catalog.listed():
        raise ModelNotFound(f"The model '{model_id}' does not exist.", param="model")
    return _card(request, model_id)
