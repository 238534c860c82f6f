"""GET /metrics (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from server.metrics import CONTENT_TYPE
from server.routes.dependencies import Serving

router = APIRouter()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(serving: Serving) -> Response:
    return Response(serving.metrics.render(), media_type=CONTENT_TYPE)
