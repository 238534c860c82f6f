"""Routes of the per-session Larimar memory (`memory_store.larimar`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from memory_store.service import MemoryStoreService


class LarimarWriteBody(BaseModel):
    text: str | None = None
    segments: list[str] | None = None
    save: bool = False


class LarimarReadBody(BaseModel):
    query: str
    top_k: int = Field(3, ge=1, le=1000)
    use_prefix: bool = True


def build_router(svc: MemoryStoreService) -> APIRouter:
    """The Larimar routes over `svc`."""
    router = APIRouter()

    # Larimar ----------------------------------------------------------------------------------

    @router.post("/v1/sessions/{session_id}/larimar/write")
    async def larimar_write(session_id: str, body: LarimarWriteBody) -> dict[str, Any]:
        async with svc.track("larimar_write"):
            written = await svc.larimar.write(session_id, text=body.text, segments=body.segments)
            if body.save:
                await svc.larimar.save(session_id)
        return {"written": written, "saved": body.save}

    @router.post("/v1/sessions/{session_id}/larimar/read")
    async def larimar_read(session_id: str, body: LarimarReadBody) -> dict[str, Any]:
        async with svc.track("larimar_read"):
            hits = await svc.larimar.read(session_id, body.query, body.top_k, body.use_prefix)
        return {
            "object": "list",
            "data": [
                {
                    "slot": h.slot,
                    "segment_indices": list(h.segment_indices),
                    "texts": list(h.texts),
                    "distance": h.distance,
                }
                for h in hits
            ],
        }

    @router.post("/v1/sessions/{session_id}/larimar/save")
    async def larimar_save(session_id: str) -> dict[str, Any]:
        async with svc.track("larimar_save"):
            await svc.larimar.save(session_id)
        return {"saved": True}

    @router.post("/v1/sessions/{session_id}/larimar/load")
    async def larimar_load(session_id: str) -> dict[str, Any]:
        async with svc.track("larimar_load"):
            await svc.larimar.load(session_id)
            info = await svc.larimar.info(session_id)
        return info

    @router.get("/v1/sessions/{session_id}/larimar")
    async def larimar_info(session_id: str) -> dict[str, Any]:
        async with svc.track("larimar_info"):
            info = await svc.larimar.info(session_id)
        return info

    return router
