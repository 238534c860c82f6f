"""GET /health (liveness: 200 while the process lives), GET /ready (the engine can serve)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    engine = request.app.state.serving.engine
    try:
        state = await engine.health()
        ok, detail = state.ok, state.detail
    except Exception as exc:  # a broken engine is "not ready", never a 500
        ok, detail = False, f"health check failed: {exc}"
    body = {"status": "ready" if ok else "unavailable", "detail": detail}
    return JSONResponse(body, status_code=200 if ok else 503)
