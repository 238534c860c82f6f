"""The memory service's state, shared by its routers: the stores over one backend, per-operation
metrics, and the request-body size limit."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from fastapi import Request

from memory_store.backends.base import Backend
from memory_store.encoding_store import EncodingStore
from memory_store.errors import InvalidStoreRequest
from memory_store.larimar import LarimarStore
from memory_store.metrics import MemoryStoreMetrics
from memory_store.observed import observed
from memory_store.reclaim import Reclaimer, ReclaimReport
from memory_store.records import RecordStore
from memory_store.settings import MemoryStoreSettings
from memory_store.usage import release_session

OCTET = "application/octet-stream"


class PayloadTooLarge(InvalidStoreRequest):
    """Request body over `max_blob_bytes`. -> 413."""


@dataclass
class MemoryStoreService:
    settings: MemoryStoreSettings
    backend: Backend
    encodings: EncodingStore
    records: RecordStore
    larimar: LarimarStore
    metrics: MemoryStoreMetrics
    reclaimer: Reclaimer = field(init=False)

    def __post_init__(self) -> None:
        self.reclaimer = Reclaimer(self.backend, on_session_expired=release_session(self.backend))

    def track(self, op: str) -> AbstractAsyncContextManager[None]:
        """Count and time one operation, labelled with its outcome."""
        return observed(self.metrics.observe, op, self.backend.name)

    async def sweep(self, chunk_grace_s: float | None = None) -> ReclaimReport:
        """Expired sessions and unused chunks (memory_store/reclaim.py), counted."""
        grace = self.settings.chunk_grace_s if chunk_grace_s is None else chunk_grace_s
        async with self.track("reclaim"):
            report = await self.reclaimer.sweep(grace)
        self.metrics.count_reclaimed(report.to_record())
        return report

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused (413) past `settings.max_blob_bytes`."""
        limit = self.settings.max_blob_bytes
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > limit:
            raise PayloadTooLarge(f"body of {declared} bytes exceeds max_blob_bytes={limit}")
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds max_blob_bytes={limit}")
            chunks.append(piece)
        return b"".join(chunks)
