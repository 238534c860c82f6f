"""A session's turns on the server's side: counted as the engine reports them, stored before
the answer's last byte, and measured against the tenant's memory budget (issue #19)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.protocol import SessionTurn
from memory_store.errors import StoreError
from server.errors import session_conflict
from server.sessions.context import Remove
from server.sessions.models import Session
from server.sessions.quotas import memory_tokens
from server.sessions.records import SessionStore, TurnConflict

logger = logging.getLogger(__name__)


def memory_room(budget: int, sessions: list[Session]) -> int:
    """How many tokens a tenant's `sessions` may still add to their memories, within its
    `budget` (max_memory_tokens_per_tenant)."""
    return budget - memory_tokens(sessions)


async def record_turns(
    store: SessionStore | None,
    remove: Remove,
    session: Session,
    turns: Sequence[SessionTurn],
    at: float,
) -> None:
    """Count the turns a finished request carried out, then store every turn not stored yet,
    in order. Raises the store's error (the request answers 503) and keeps what it could not
    store for the next finished request to store first."""
    session.take_turns(turns, at)
    async with session.turn_lock:  # one writer per session: turns go in seq order
        if store is None or session.removed:
            session.unsaved.clear()
            return
        while session.unsaved:
            try:
                await store.save_turn(session.tenant, session.id, session.unsaved[0])
            except TurnConflict as exc:  # answered on a stale copy: forget it, never ack
                await remove(session, "it changed on another replica")
                raise session_conflict(session.id) from exc
            session.unsaved.pop(0)


async def stale(store: SessionStore | None, session: Session) -> bool:
    """Whether another replica took a turn on the session after this copy's last one."""
    if store is None:
        return False
    try:
        return await store.has_turn(session.tenant, session.id, session.seq + 1)
    except StoreError as exc:
        logger.debug("could not check session %s's turns: %s", session.id, exc)
        return False
