"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from server.auth import require_tenant
from server.errors import error_responses
from server.limits import JSONBodyRoute
from server.protocol import ChatCompletion, ChatCompletionRequest
from server.routes.dependencies import Serving
from server.serving.chat import create_chat_completion
from server.serving.sse import STREAM_OK

router = APIRouter(
    prefix="/v1",
    route_class=JSONBodyRoute,
    responses=error_responses(400, 401, 404, 409, 413, 415, 429, 431, 500, 503),
)


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAM_OK)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    serving: Serving,
    tenant: str = Depends(require_tenant),
) -> ChatCompletion | Response:
    return await create_chat_completion(serving, body, request, tenant)
