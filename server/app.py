"""build_app(settings, engine): the FastAPI application around one EngineClient."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.protocol import EngineClient
from server.errors import install_error_handlers
from server.limits import BodySizeLimit
from server.metrics import Metrics
from server.routes import chat, completions, health, metrics, models, sessions
from server.serving import ServingContext
from server.sessions import SessionRegistry
from server.settings import ServerSettings

logger = logging.getLogger(__name__)


def build_app(settings: ServerSettings, engine: EngineClient) -> FastAPI:
    """An app serving `engine`; its lifespan shuts the engine down when the server stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry.start()  # the TTL sweeper
        try:
            yield
        finally:
            await registry.close()
            logger.info("shutting the engine down")
            await engine.shutdown()

    app = FastAPI(title="longserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app_metrics = Metrics(engine.stats)
    registry = SessionRegistry(engine, settings, app_metrics)
    app.state.serving = ServingContext(engine=engine, settings=settings, metrics=app_metrics)
    app.state.sessions = registry
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    for module in (health, metrics, models, chat, completions, sessions):
        app.include_router(module.router)
    return app
