"""build_app(settings, engine, store): the FastAPI application around one EngineClient and,
optionally, the memory store that makes its sessions durable and shared by replicas."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine.protocol import EngineClient
from memory_store.client import MemoryStoreClient
from server.drain import DrainGate, DrainState
from server.error_mapping import install_error_handlers
from server.limits import BodySizeLimit, HeadSizeLimit, RefuseEncodedBodies
from server.metrics import Metrics
from server.routes import (
    chat,
    completions,
    health,
    metrics,
    models,
    responses,
    sessions,
    tokenize,
)
from server.serving.context import ServingContext
from server.serving.response_store import ResponseStore
from server.sessions import SessionRegistry
from server.sessions.records import SessionStore
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


def build_app(
    settings: ServerSettings, engine: EngineClient, store: MemoryStoreClient | None = None
) -> FastAPI:
    """An app serving `engine`; its lifespan shuts the engine down when the server stops.

    `store`: the memory store holding session records (the app owns it and closes it). None
    keeps sessions in this process only: gone on restart, invisible to other replicas.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()  # the TTL sweeper
        try:
            yield
        finally:
            await registry.close()
            logger.info("shutting the engine down")
            await engine.shutdown()
            if store is not None:
                await store.close()

    app = FastAPI(title="longserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app_metrics = Metrics(
        engine.stats,
        model_name=engine.model.id,
        memory_tokens_budget=settings.max_memory_tokens_per_tenant * settings.tenant_count(),
    )
    if store is not None and store.on_request is None:
        store.on_request = app_metrics.memory_store_request
    session_store = SessionStore(store) if store is not None else None
    registry = SessionRegistry(engine, settings, app_metrics, store=session_store)
    app.state.serving = ServingContext(
        engine=engine,
        settings=settings,
        metrics=app_metrics,
        sessions=registry,
        responses=ResponseStore(
            settings.max_stored_responses,
            store,
            max_bytes=settings.max_stored_response_bytes_per_tenant,
            on_totals=app_metrics.tenant_usage,
        ),
    )
    app.state.sessions = registry
    app.state.memory_store = session_store
    app.state.drain = DrainState(settings.drain_timeout_seconds)
    install_error_handlers(app)
    # Outermost last: a draining server refuses before anything else; then head size, body
    # encoding, body size.
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(RefuseEncodedBodies)
    app.add_middleware(HeadSizeLimit)
    app.add_middleware(DrainGate, state=app.state.drain)
    for module in (health, metrics, models, chat, completions, responses, sessions, tokenize):
        app.include_router(module.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, made honest: validation errors are OpenAI-shaped 400s (declared on
    each router), never FastAPI's 422, so the 422 responses and their schemas go."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema
