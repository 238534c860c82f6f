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
    POST   /v1/usage/{tenant}/claim                       {"item", "amounts", "limits"} -> claim
    POST   /v1/usage/{tenant}/release                     {"item"} -> {"granted", "totals"}
    GET    /v1/usage/{tenant}                             {"granted", "totals"}
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from memory_store.backends.base import Backend
from memory_store.embedder import Embedder, TextEncoder
from memory_store.encoding_store import EncodingStore
from memory_store.errors import (
    Conflict,
    InvalidStoreRequest,
    NotFound,
    StoreError,
    StoreUnavailableError,
)
from memory_store.larimar import LarimarConfig, LarimarStore
from memory_store.metrics import MemoryStoreMetrics
from memory_store.records import RecordStore
from memory_store.routes import encodings, larimar, records, usage
from memory_store.service import MemoryStoreService, PayloadTooLarge
from memory_store.settings import MemoryStoreSettings

logger = logging.getLogger(__name__)


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

    app.include_router(encodings.build_router(svc))
    app.include_router(records.build_router(svc))
    app.include_router(larimar.build_router(svc))
    app.include_router(usage.build_router(svc))
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
