"""GET /health (liveness: 200 while the process lives), GET /ready (the engine can serve, the
memory store answers, and the server is not draining)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.routes.dependencies import Drain, Serving, SessionRecords

logger = logging.getLogger(__name__)
router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/ready",
    responses={
        200: {"description": "The engine can serve and the memory store answers."},
        503: {
            "description": "The engine or the memory store is not available, or the server "
            "is draining."
        },
    },
)
async def ready(drain: Drain, serving: Serving, store: SessionRecords) -> JSONResponse:
    if drain.draining:  # load balancers: stop sending here
        body = {"status": "draining", "detail": "the server is shutting down"}
        return JSONResponse(body, status_code=503)
    # No key is needed here: the body names the failing part only; why goes to the log.
    engine = serving.engine
    try:
        state = await engine.health()
        ok, why = state.ok, state.detail
    except Exception as exc:  # a broken engine is "not ready", never a 500
        ok, why = False, repr(exc)
    detail = "ready" if ok else "engine unavailable"
    if ok and store is not None:
        try:
            await store.ping()
        except Exception as exc:  # down or unreachable: not ready, the process stays up
            ok, why, detail = False, repr(exc), "memory store unavailable"
    if not ok:
        logger.warning("not ready: %s (%s)", detail, why)
    body = {"status": "ready" if ok else "unavailable", "detail": detail}
    return JSONResponse(body, status_code=200 if ok else 503)
