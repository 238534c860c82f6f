"""FastAPI dependencies: the app's collaborators, built once by build_app (server/app.py) and
kept on app.state, handed to the routes by type."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.drain import DrainState
from server.serving.context import ServingContext
from server.sessions import SessionRegistry
from server.sessions.records import SessionStore


def serving_context(request: Request) -> ServingContext:
    context: ServingContext = request.app.state.serving
    return context


def session_registry(request: Request) -> SessionRegistry:
    registry: SessionRegistry = request.app.state.sessions
    return registry


def drain_state(request: Request) -> DrainState:
    state: DrainState = request.app.state.drain
    return state


def session_store(request: Request) -> SessionStore | None:
    store: SessionStore | None = request.app.state.memory_store
    return store


Serving = Annotated[ServingContext, Depends(serving_context)]
Sessions = Annotated[SessionRegistry, Depends(session_registry)]
Drain = Annotated[DrainState, Depends(drain_state)]
SessionRecords = Annotated[SessionStore | None, Depends(session_store)]
