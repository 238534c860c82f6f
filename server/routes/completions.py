"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from server.auth import require_tenant
from server.protocol import Completion, CompletionRequest
from server.serving_completion import create_completion

router = APIRouter(prefix="/v1")


@router.post("/completions", response_model=Completion)
async def completions(
    body: CompletionRequest, request: Request, tenant: str = Depends(require_tenant)
) -> Completion | Response:
    return await create_completion(request.app.state.serving, body, request, tenant)
