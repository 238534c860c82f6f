"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from server.auth import require_tenant
from server.errors import error_responses
from server.limits import JSONBodyRoute
from server.protocol import Completion, CompletionRequest
from server.routes.dependencies import Serving
from server.serving.completions import create_completion
from server.serving.sse import STREAM_OK

router = APIRouter(
    prefix="/v1",
    route_class=JSONBodyRoute,
    responses=error_responses(400, 401, 404, 409, 413, 415, 429, 431, 500, 503),
)


@router.post("/completions", response_model=Completion, responses=STREAM_OK)
async def completions(
    body: CompletionRequest,
    request: Request,
    serving: Serving,
    tenant: str = Depends(require_tenant),
) -> Completion | Response:
    return await create_completion(serving, body, request, tenant)
