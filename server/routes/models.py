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


def _cards(engine: EngineClient) -> list[ModelCard]:
    """The served model, then each of its answer adapters."""
    info = engine.model
    base = ModelCard(
        id=info.id,
        created=info.created,
        max_model_len=info.max_model_len,
        strategies=list(info.strategies),
    )
    adapters = [base.model_copy(update={"id": name, "parent": info.id}) for name in info.adapters]
    return [base, *adapters]


@router.get("/models", response_model=ModelList)
async def list_models(serving: Serving) -> ModelList:
    return ModelList(data=_cards(serving.engine))


@router.get("/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, serving: Serving) -> ModelCard:
    for card in _cards(serving.engine):
        if card.id == model_id:
            return card
    raise model_not_found(model_id)
