"""What the registry hands its helpers (documents, collections, restores, the sweeper, the
listing): the services they read (`SessionServices`) and the table of held sessions
(`HeldSessions`), never the registry itself; the few registry calls a helper makes back
(lookup, touch, remove) reach it as plain callables."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine.protocol import EngineClient
from server.errors import session_not_found
from server.sessions.models import Session
from server.sessions.records import SessionStore
from server.sessions.usage import SessionUsage
from server.settings import ServerSettings

Lookup = Callable[[str, str], Awaitable[Session]]  # (tenant, session id): held or restored
Touch = Callable[[Session], None]  # mark used (and save last_used in the background)
Remove = Callable[[Session, str], Awaitable[None]]  # forget here, with the reason


@dataclass(frozen=True)
class SessionServices:
    """The engine, the settings, the store (None: sessions live here only), the clock and
    the tenants' usage ledger (usage.py)."""

    engine: EngineClient
    settings: ServerSettings
    store: SessionStore | None
    clock: Callable[[], float]
    usage: SessionUsage


class HeldSessions:
    """Every session this replica holds, by tenant. Everything runs on one loop."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, dict[str, Session]] = {}

    def of(self, tenant: str) -> list[Session]:
        return list(self._by_tenant.get(tenant, {}).values())

    def all(self) -> list[Session]:
        return [s for sessions in self._by_tenant.values() for s in sessions.values()]

    def find(self, tenant: str, session_id: str) -> Session | None:
        return self._by_tenant.get(tenant, {}).get(session_id)

    def get(self, tenant: str, session_id: str) -> Session:
        """A held session; 404 when it is not held (no restore)."""
        session = self.find(tenant, session_id)
        if session is None:
            raise session_not_found(session_id)
        return session

    def hold(self, session: Session) -> Session:
        """Register `session`; a session already held under its id stays (never hold two)."""
        held = self._by_tenant.setdefault(session.tenant, {})
        return held.setdefault(session.id, session)

    def release(self, session: Session) -> bool:
        """Let `session` go; False when it was not the one held under its id."""
        tenant_sessions = self._by_tenant.get(session.tenant, {})
        if tenant_sessions.get(session.id) is not session:
            return False
        del tenant_sessions[session.id]
        if not tenant_sessions:
            self._by_tenant.pop(session.tenant, None)
        return True
