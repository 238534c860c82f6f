"""POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI's Responses API)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from server.auth import require_tenant
from server.errors import error_responses
from server.limits import JSONBodyRoute
from server.protocol import ResponseCreateRequest
from server.routes.dependencies import Serving
from server.serving.responses import create_response
from server.serving.sse import STREAM_OK

router = APIRouter(
    prefix="/v1",
    route_class=JSONBodyRoute,
    responses=error_responses(400, 401, 404, 409, 413, 415, 429, 431, 500, 503),
)


@router.post("/responses", responses=STREAM_OK)
async def responses_create(
    body: ResponseCreateRequest,
    request: Request,
    serving: Serving,
    tenant: str = Depends(require_tenant),
) -> Any:
    return await create_response(serving, body, request, tenant)


@router.get("/responses/{response_id}")
async def responses_get(
    response_id: str, serving: Serving, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    return (await serving.responses.get(tenant, response_id)).body


@router.delete("/responses/{response_id}")
async def responses_delete(
    response_id: str, serving: Serving, tenant: str = Depends(require_tenant)
) -> dict[str, Any]:
    await serving.responses.delete(tenant, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
