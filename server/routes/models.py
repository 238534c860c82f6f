"""GET /v1/models, GET /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from engine.protocol import EngineClient
from server.auth import require_tenant
from server.errors import error_responses, model_not_found
from server.protocol import ModelCard, ModelList
from server.routes.dependencies import Serving

router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_tenant)],
    responses=error_responses(401, 404, 431, 500, 503),
)


def _card(engine: EngineClient) -> ModelCard:
    info = engine.model
    return ModelCard(
        id=info.id,
        created=info.created,
        max_model_len=info.max_model_len,
        strategies=list(info.strategies),
    )


@router.get("/models", response_model=ModelList)
async def list_models(serving: Serving) -> ModelList:
    return ModelList(data=[_card(serving.engine)])


@router.get("/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, serving: Serving) -> ModelCard:
    card = _card(serving.engine)
    if model_id != card.id:
        raise model_not_found(model_id)
    return card
