"""Routes of the per-tenant usage ledger (`memory_store.usage`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from memory_store.service import MemoryStoreService
from memory_store.usage import UsageClaim, UsageLedger


class ClaimBody(BaseModel):
    item: str
    amounts: dict[str, int] = Field(max_length=16)
    limits: dict[str, int] = Field(default_factory=dict, max_length=16)


class ReleaseBody(BaseModel):
    item: str


def build_router(svc: MemoryStoreService) -> APIRouter:
    """The ledger routes over `svc`'s backend."""
    router = APIRouter()
    ledger = UsageLedger(svc.backend)

    @router.post("/v1/usage/{tenant}/claim")
    async def claim(tenant: str, body: ClaimBody) -> dict[str, Any]:
        async with svc.track("claim_usage"):
            result = await ledger.claim(tenant, body.item, body.amounts, body.limits)
        return result.to_json()

    @router.post("/v1/usage/{tenant}/release")
    async def release(tenant: str, body: ReleaseBody) -> dict[str, Any]:
        async with svc.track("release_usage"):
            totals = await ledger.release(tenant, body.item)
        return UsageClaim(True, totals).to_json()

    @router.get("/v1/usage/{tenant}")
    async def usage(tenant: str) -> dict[str, Any]:
        async with svc.track("usage"):
            totals = await ledger.totals(tenant)
        return UsageClaim(True, totals).to_json()

    return router
