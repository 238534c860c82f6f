"""ServingContext: the collaborators every serving function receives, built once by build_app
(server/app.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.protocol import EngineClient
from server.metrics import Metrics
from server.serving.response_store import ResponseStore
from server.sessions import SessionRegistry
from server.settings import ServerSettings


@dataclass
class ServingContext:
    engine: EngineClient
    settings: ServerSettings
    metrics: Metrics
    sessions: SessionRegistry
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(1000))
