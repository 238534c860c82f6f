"""Listing a tenant's sessions: those of every replica when the store's tenant index answers,
else those this replica holds (a partial list beats a 503 for a read that changes nothing)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from memory_store.errors import InvalidStoreRequest, StoreError
from server.protocol_sessions import SessionObject
from server.sessions.models import Session, stored_view
from server.sessions.records import SessionRecord

if TYPE_CHECKING:
    from server.sessions.registry import SessionRegistry

logger = logging.getLogger(__name__)


async def list_session_views(registry: SessionRegistry, tenant: str) -> list[SessionObject]:
    """The tenant's sessions, oldest first: every one the store's tenant index names (held
    here or not: another replica's appear too), else, with no store or the store down,
    the ones this replica holds. Listing never restores a session (no engine work).

    A held session the index no longer names was deleted through another replica: it is
    let go here too. Index entries whose record is gone (a delete half done) or expired
    are skipped.
    """
    held = {s.id: s for s in registry.sessions(tenant)}
    if registry.store is None:
        return [registry.view(s) for s in sorted(held.values(), key=_created)]
    try:
        ids = await registry.store.session_ids(tenant)
        records = await asyncio.gather(
            *(_load_listed(registry, tenant, sid) for sid in ids if sid not in held)
        )
    except StoreError as exc:
        logger.info("listing sessions from the memory store failed (%s): held ones only", exc)
        return [registry.view(s) for s in sorted(held.values(), key=_created)]
    indexed = set(ids)
    for session in held.values():
        if session.id not in indexed and await registry.gone_from_store(session):
            await registry.remove(session, "The session was deleted.")
    now = registry.clock()
    still_held = {s.id: s for s in registry.sessions(tenant)}
    dated = [(s.created_at, s.id, registry.view(s)) for s in still_held.values()]
    dated += [
        (record.created_at, record.id, stored_view(record))
        for record in records
        if record is not None and not record.expired(now) and record.id not in still_held
    ]
    return [view for _, _, view in sorted(dated, key=lambda d: (d[0], d[1]))]


async def _load_listed(
    registry: SessionRegistry, tenant: str, session_id: str
) -> SessionRecord | None:
    """A listed session's record; None (logged) for one that cannot be read back, so one
    bad record does not hide the others. An unreachable store still raises."""
    assert registry.store is not None
    try:
        return await registry.store.load(tenant, session_id)
    except InvalidStoreRequest as exc:
        logger.warning("session %s in the tenant index is unreadable: %s", session_id, exc)
        return None


def _created(session: Session) -> tuple[float, str]:
    return session.created_at, session.id
