"""Listing a tenant's sessions: those of every replica when the store's tenant index answers,
else those this replica holds (a partial list beats a 503 for a read that changes nothing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from memory_store.errors import InvalidStoreRequest, StoreError
from server.protocol_sessions import SessionObject
from server.sessions.context import HeldSessions, Remove
from server.sessions.models import Session, stored_view
from server.sessions.records import SessionRecord, SessionStore

logger = logging.getLogger(__name__)


async def list_session_views(
    store: SessionStore | None,
    held: HeldSessions,
    tenant: str,
    view: Callable[[Session], SessionObject],
    remove: Remove,
    clock: Callable[[], float],
) -> list[SessionObject]:
    """The tenant's sessions, oldest first: every one the store's tenant index names (held
    here or not: another replica's appear too), else, with no store or the store down,
    the ones this replica holds. Listing never restores a session (no engine work).

    A held session the index no longer names was deleted through another replica: it is
    let go here too. Index entries whose record is gone (a delete half done) or expired
    are skipped.
    """
    held_here = {s.id: s for s in held.of(tenant)}
    if store is None:
        return [view(s) for s in sorted(held_here.values(), key=_created)]
    try:
        ids = await store.session_ids(tenant)
        records = await asyncio.gather(
            *(_load_listed(store, tenant, sid) for sid in ids if sid not in held_here)
        )
    except StoreError as exc:
        logger.info("listing sessions from the memory store failed (%s): held ones only", exc)
        return [view(s) for s in sorted(held_here.values(), key=_created)]
    indexed = set(ids)
    for session in held_here.values():
        if session.id not in indexed and await gone_from_store(store, session):
            await remove(session, "The session was deleted.")
    now = clock()
    still_held = {s.id: s for s in held.of(tenant)}
    dated = [(s.created_at, s.id, view(s)) for s in still_held.values()]
    dated += [
        (record.created_at, record.id, stored_view(record))
        for record in records
        if record is not None and not record.expired(now) and record.id not in still_held
    ]
    return [listed for _, _, listed in sorted(dated, key=lambda d: (d[0], d[1]))]


async def gone_from_store(store: SessionStore | None, session: Session) -> bool:
    """True only when the store answers that the session's record is gone (deleted through
    another replica); a store that cannot answer keeps held sessions serving."""
    if store is None:
        return False
    try:
        return not await store.exists(session.tenant, session.id)
    except StoreError as exc:
        logger.debug("could not check session %s in the memory store: %s", session.id, exc)
        return False


async def _load_listed(store: SessionStore, tenant: str, session_id: str) -> SessionRecord | None:
    """A listed session's record; None (logged) for one that cannot be read back, so one
    bad record does not hide the others. An unreachable store still raises."""
    try:
        return await store.load(tenant, session_id)
    except InvalidStoreRequest as exc:
        logger.warning("session %s in the tenant index is unreadable: %s", session_id, exc)
        return None


def _created(session: Session) -> tuple[float, str]:
    return session.created_at, session.id
