"""GET /metrics (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.serving.metrics.render(), media_type=CONTENT_TYPE)
