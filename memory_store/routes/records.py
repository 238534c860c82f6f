"""Routes of the generic records and blobs (`memory_store.records`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field

from memory_store.service import OCTET, MemoryStoreService


class ReclaimBody(BaseModel):
    chunk_grace_s: float | None = Field(default=None, ge=0)


def build_router(svc: MemoryStoreService) -> APIRouter:
    """The record and blob routes over `svc`."""
    router = APIRouter()

    # Records and blobs ------------------------------------------------------------------------

    @router.put("/v1/records/{namespace}/{key}")
    async def put_record(namespace: str, key: str, record: dict[str, Any]) -> dict[str, Any]:
        async with svc.track("put_record"):
            await svc.records.put_record(namespace, key, record)
        return record

    @router.get("/v1/records/{namespace}/{key}")
    async def get_record(namespace: str, key: str) -> dict[str, Any]:
        async with svc.track("get_record"):
            return await svc.records.get_record(namespace, key)

    @router.get("/v1/records/{namespace}")
    async def list_records(namespace: str, prefix: str = "") -> dict[str, Any]:
        async with svc.track("list_records"):
            records = await svc.records.list_records(namespace, prefix)
        return {
            "object": "list",
            "data": [{"key": key, "record": record} for key, record in records.items()],
        }

    @router.delete("/v1/records/{namespace}/{key}")
    async def delete_record(namespace: str, key: str) -> dict[str, Any]:
        async with svc.track("delete_record"):
            deleted = await svc.records.delete_record(namespace, key)
        return {"key": key, "deleted": deleted}

    @router.put("/v1/blobs/{namespace}/{key}")
    async def put_blob(namespace: str, key: str, request: Request) -> dict[str, Any]:
        async with svc.track("put_blob"):
            data = await svc.read_body(request)
            await svc.records.put_blob(namespace, key, data)
        return {"key": key, "bytes": len(data)}

    @router.get("/v1/blobs/{namespace}/{key}")
    async def get_blob(namespace: str, key: str) -> Response:
        async with svc.track("get_blob"):
            data = await svc.records.get_blob(namespace, key)
        return Response(data, media_type=OCTET)

    @router.delete("/v1/blobs/{namespace}/{key}")
    async def delete_blob(namespace: str, key: str) -> dict[str, Any]:
        async with svc.track("delete_blob"):
            deleted = await svc.records.delete_blob(namespace, key)
        return {"key": key, "deleted": deleted}

    @router.post("/v1/reclaim")
    async def reclaim(body: ReclaimBody | None = None) -> dict[str, Any]:
        report = await svc.sweep(body.chunk_grace_s if body is not None else None)
        return report.to_record()

    return router
