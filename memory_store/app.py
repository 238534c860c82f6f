"""The memory service over HTTP (`longserve memory-store`).

Chunk encodings travel as `application/octet-stream` in the chunk wire format
(`memory_store.encodings.encode_chunk`); everything else is JSON. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; an unreachable backend is a 503.

    GET    /health                                        liveness
    GET    /ready                                         backend reachable
    GET    /metrics                                       Prometheus (own registry)
    PUT    /v1/chunks/{fingerprint}/{chain_hash}          body: chunk bytes -> {"created"}
    HEAD   /v1/chunks/{fingerprint}/{chain_hash}          200 or 404
    GET    /v1/chunks/{fingerprint}/{chain_hash}          chunk bytes
    PUT    /v1/sessions/{sid}/documents/{doc_id}          manifest JSON
    GET    /v1/sessions/{sid}/documents/{doc_id}          manifest JSON
    GET    /v1/sessions/{sid}/documents                   {"object": "list", "data": [...]}
    DELETE /v1/sessions/{sid}                             manifests and Larimar memory
    POST   /v1/collections/{name}/chunks                  {"fingerprint", "chain_hashes", "dim", "embeddings_b64"}
    POST   /v1/collections/{name}/select                  {"query_embedding", "top_k"}
    GET    /v1/collections/{name}/chunks                  every chunk, in document order
    DELETE /v1/collections/{name}
    PUT    /v1/records/{namespace}/{key}                  JSON object (namespace "sess:ID" | "tenant:ID")
    GET    /v1/records/{namespace}/{key}                  the object
    GET    /v1/records/{namespace}?prefix=P               {"object": "list", "data": [{"key", "record"}]}
    DELETE /v1/records/{namespace}/{key}                  {"deleted"}
    PUT    /v1/blobs/{namespace}/{key}                    body: bytes
    GET    /v1/blobs/{namespace}/{key}                    bytes
    POST   /v1/sessions/{sid}/larimar/write               {"text" | "segments", "save"}
    POST   /v1/sessions/{sid}/larimar/read                {"query", "top_k", "use_prefix"}
    POST   /v1/sessions/{sid}/larimar/save | /load
    GET    /v1/sessions/{sid}/larimar                     {"segments", "slots", "dim"}
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from memory_store.backends import Backend
from memory_store.embedder import Embedder, TextEncoder
from memory_store.encodings import DocumentManifest, EncodingStore, embeddings_from_bytes
from memory_store.errors import (
    Conflict,
    InvalidStoreRequest,
    NotFound,
    StoreError,
    StoreUnavailableError,
    status_label,
)
from memory_store.larimar import LarimarConfig, LarimarStore
from memory_store.metrics import MemoryStoreMetrics
from memory_store.records import RecordStore
from memory_store.settings import MemoryStoreSettings

logger = logging.getLogger(__name__)

OCTET = "application/octet-stream"


class PayloadTooLarge(InvalidStoreRequest):
    """Request body over `max_blob_bytes`. -> 413."""


# ---------------------------------------------------------------------------------------------
# Request bodies.
# ---------------------------------------------------------------------------------------------


class ManifestBody(BaseModel):
    doc_id: str
    fingerprint: str
    chunk_hashes: list[str]
    name: str = ""
    num_tokens: int = 0
    created_at: float = 0.0
    meta: dict[str, Any] = Field(default_factory=dict)


class CollectionAddBody(BaseModel):
    fingerprint: str
    chain_hashes: list[str]
    dim: int = Field(gt=0)
    embeddings_b64: str  # little-endian float32, row-major (n, dim)


class CollectionSelectBody(BaseModel):
    query_embedding: list[float]
    top_k: int = Field(8, ge=1, le=10_000)


class LarimarWriteBody(BaseModel):
    text: str | None = None
    segments: list[str] | None = None
    save: bool = False


class LarimarReadBody(BaseModel):
    query: str
    top_k: int = Field(3, ge=1, le=1000)
    use_prefix: bool = True


# ---------------------------------------------------------------------------------------------
# Errors in OpenAI's shape.
# ---------------------------------------------------------------------------------------------


def error_response(
    status: int, message: str, type_: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def store_error_response(exc: StoreError) -> JSONResponse:
    if isinstance(exc, StoreUnavailableError):
        return error_response(503, str(exc), "server_error", "memory_store_unavailable")
    if isinstance(exc, NotFound):
        return error_response(404, str(exc), "invalid_request_error", "not_found")
    if isinstance(exc, Conflict):
        return error_response(409, str(exc), "invalid_request_error", "conflict")
    if isinstance(exc, PayloadTooLarge):
        return error_response(413, str(exc), "invalid_request_error", "payload_too_large")
    if isinstance(exc, InvalidStoreRequest):
        return error_response(400, str(exc), "invalid_request_error", "invalid_value")
    logger.error("memory store error: %s", exc)
    return error_response(500, str(exc), "server_error", "memory_store_error")


# ---------------------------------------------------------------------------------------------
# The app.
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryStoreService:
    settings: MemoryStoreSettings
    backend: Backend
    encodings: EncodingStore
    records: RecordStore
    larimar: LarimarStore
    metrics: MemoryStoreMetrics

    @asynccontextmanager
    async def track(self, op: str) -> AsyncIterator[None]:
        """Count and time one operation, labelled with its outcome."""
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            yield
        except BaseException as e:
            error = e
            raise
        finally:
            self.metrics.observe(
                op, self.backend.name, status_label(error), time.perf_counter() - start
            )


def build_app(
    settings: MemoryStoreSettings | None = None,
    *,
    backend: Backend | None = None,
    encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
) -> FastAPI:
    """The memory service. `backend`/`encoder` default to what `settings` describe."""
    settings = settings or MemoryStoreSettings()
    backend = backend or settings.build_backend()
    if encoder is None:
        device = settings.embedder_device

        def encoder() -> TextEncoder:
            return Embedder(device=device)

    svc = MemoryStoreService(
        settings=settings,
        backend=backend,
        encodings=EncodingStore(backend),
        records=RecordStore(backend),
        larimar=LarimarStore(
            backend, encoder, LarimarConfig(prefix_length=settings.larimar_prefix_length)
        ),
        metrics=MemoryStoreMetrics(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await svc.backend.close()

    app = FastAPI(title="longserve memory store", lifespan=lifespan)
    app.state.service = svc

    @app.exception_handler(StoreError)
    async def _store_error(request: Request, exc: StoreError) -> JSONResponse:
        return store_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
        message = errors[0]["msg"] if errors else "invalid request"
        return error_response(400, message, "invalid_request_error", "invalid_value", param)

    async def read_body(request: Request) -> bytes:
        limit = settings.max_blob_bytes
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

    # Probes -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        async with svc.track("ping"):
            await svc.backend.ping()
        return {"status": "ready", "backend": svc.backend.name}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = svc.metrics.render()
        return Response(body, media_type=content_type)

    # Chunks -----------------------------------------------------------------------------------

    @app.put("/v1/chunks/{fingerprint}/{chain_hash}")
    async def put_chunk(fingerprint: str, chain_hash: str, request: Request) -> JSONResponse:
        async with svc.track("put_chunk"):
            data = await read_body(request)
            created = await svc.encodings.put_chunk_bytes(fingerprint, chain_hash, data)
        return JSONResponse({"created": created}, status_code=201 if created else 200)

    @app.head("/v1/chunks/{fingerprint}/{chain_hash}")
    async def has_chunk(fingerprint: str, chain_hash: str) -> Response:
        async with svc.track("has_chunk"):
            found = await svc.encodings.has_chunk(fingerprint, chain_hash)
        return Response(status_code=200 if found else 404)

    @app.get("/v1/chunks/{fingerprint}/{chain_hash}")
    async def get_chunk(fingerprint: str, chain_hash: str) -> Response:
        async with svc.track("get_chunk"):
            data = await svc.encodings.get_chunk_bytes(fingerprint, chain_hash)
        return Response(data, media_type=OCTET)

    # Manifests --------------------------------------------------------------------------------

    @app.put("/v1/sessions/{session_id}/documents/{doc_id}")
    async def put_manifest(session_id: str, doc_id: str, body: ManifestBody) -> dict[str, Any]:
        async with svc.track("put_manifest"):
            manifest = DocumentManifest.from_record(body.model_dump())
            await svc.encodings.put_manifest(session_id, doc_id, manifest)
            stored = await svc.encodings.get_manifest(session_id, doc_id)
        return stored.to_record()

    @app.get("/v1/sessions/{session_id}/documents/{doc_id}")
    async def get_manifest(session_id: str, doc_id: str) -> dict[str, Any]:
        async with svc.track("get_manifest"):
            manifest = await svc.encodings.get_manifest(session_id, doc_id)
        return manifest.to_record()

    @app.get("/v1/sessions/{session_id}/documents")
    async def list_documents(session_id: str) -> dict[str, Any]:
        async with svc.track("list_documents"):
            docs = await svc.encodings.list_documents(session_id)
        return {"object": "list", "data": [d.to_record() for d in docs]}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        async with svc.track("delete_session"):
            svc.larimar.evict(session_id)
            deleted = await svc.encodings.delete_session(session_id)
        return {"id": session_id, "deleted": deleted}

    # Collections ------------------------------------------------------------------------------

    @app.post("/v1/collections/{name}/chunks")
    async def add_to_collection(name: str, body: CollectionAddBody) -> dict[str, Any]:
        async with svc.track("add_to_collection"):
            try:
                raw = base64.b64decode(body.embeddings_b64, validate=True)
            except ValueError as e:
                raise InvalidStoreRequest(f"embeddings_b64 is not base64: {e}") from e
            emb = embeddings_from_bytes(raw, body.dim)
            added = await svc.encodings.add_to_collection(
                name, body.fingerprint, body.chain_hashes, emb
            )
        return {"added": added}

    @app.post("/v1/collections/{name}/select")
    async def select_chunks(name: str, body: CollectionSelectBody) -> dict[str, Any]:
        async with svc.track("select_chunks"):
            refs = await svc.encodings.select_chunks(
                name, np.asarray(body.query_embedding, dtype=np.float32), body.top_k
            )
        return {
            "object": "list",
            "data": [
                {"fingerprint": r.fingerprint, "chain_hash": r.chain_hash, "score": r.score}
                for r in refs
            ],
        }

    @app.get("/v1/collections/{name}/chunks")
    async def collection_chunks(name: str) -> dict[str, Any]:
        async with svc.track("collection_chunks"):
            refs = await svc.encodings.collection_chunks(name)
        return {
            "object": "list",
            "data": [{"fingerprint": r.fingerprint, "chain_hash": r.chain_hash} for r in refs],
        }

    @app.delete("/v1/collections/{name}")
    async def delete_collection(name: str) -> dict[str, Any]:
        async with svc.track("delete_collection"):
            deleted = await svc.encodings.delete_collection(name)
        return {"name": name, "deleted": deleted}

    # Records and blobs ------------------------------------------------------------------------

    @app.put("/v1/records/{namespace}/{key}")
    async def put_record(namespace: str, key: str, record: dict[str, Any]) -> dict[str, Any]:
        async with svc.track("put_record"):
            await svc.records.put_record(namespace, key, record)
        return record

    @app.get("/v1/records/{namespace}/{key}")
    async def get_record(namespace: str, key: str) -> dict[str, Any]:
        async with svc.track("get_record"):
            return await svc.records.get_record(namespace, key)

    @app.get("/v1/records/{namespace}")
    async def list_records(namespace: str, prefix: str = "") -> dict[str, Any]:
        async with svc.track("list_records"):
            records = await svc.records.list_records(namespace, prefix)
        return {
            "object": "list",
            "data": [{"key": key, "record": record} for key, record in records.items()],
        }

    @app.delete("/v1/records/{namespace}/{key}")
    async def delete_record(namespace: str, key: str) -> dict[str, Any]:
        async with svc.track("delete_record"):
            deleted = await svc.records.delete_record(namespace, key)
        return {"key": key, "deleted": deleted}

    @app.put("/v1/blobs/{namespace}/{key}")
    async def put_blob(namespace: str, key: str, request: Request) -> dict[str, Any]:
        async with svc.track("put_blob"):
            data = await read_body(request)
            await svc.records.put_blob(namespace, key, data)
        return {"key": key, "bytes": len(data)}

    @app.get("/v1/blobs/{namespace}/{key}")
    async def get_blob(namespace: str, key: str) -> Response:
        async with svc.track("get_blob"):
            data = await svc.records.get_blob(namespace, key)
        return Response(data, media_type=OCTET)

    # Larimar ----------------------------------------------------------------------------------

    @app.post("/v1/sessions/{session_id}/larimar/write")
    async def larimar_write(session_id: str, body: LarimarWriteBody) -> dict[str, Any]:
        async with svc.track("larimar_write"):
            written = await svc.larimar.write(session_id, text=body.text, segments=body.segments)
            if body.save:
                await svc.larimar.save(session_id)
        return {"written": written, "saved": body.save}

    @app.post("/v1/sessions/{session_id}/larimar/read")
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

    @app.post("/v1/sessions/{session_id}/larimar/save")
    async def larimar_save(session_id: str) -> dict[str, Any]:
        async with svc.track("larimar_save"):
            await svc.larimar.save(session_id)
        return {"saved": True}

    @app.post("/v1/sessions/{session_id}/larimar/load")
    async def larimar_load(session_id: str) -> dict[str, Any]:
        async with svc.track("larimar_load"):
            await svc.larimar.load(session_id)
            info = await svc.larimar.info(session_id)
        return info

    @app.get("/v1/sessions/{session_id}/larimar")
    async def larimar_info(session_id: str) -> dict[str, Any]:
        async with svc.track("larimar_info"):
            info = await svc.larimar.info(session_id)
        return info

    return app


def serve(settings: MemoryStoreSettings) -> None:
    """Run the service in the foreground with uvicorn."""
    import uvicorn

    if not settings.binds_loopback:
        logger.warning(
            "memory store listening on %s without authentication: keep it on a private network",
            settings.host,
        )
    uvicorn.run(
        build_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level
    )
