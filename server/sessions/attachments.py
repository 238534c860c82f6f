"""Collections attached to a session. Collections are written by the operator (`longserve
ingest`) and readable by every tenant; what is per tenant is the session that attaches them."""

from __future__ import annotations

import contextlib
import logging
import re

from engine.protocol import CollectionIncompatible, CollectionNotFound
from memory_store.errors import StoreError
from server.errors import invalid_request, session_busy
from server.sessions.context import Lookup, SessionServices, Touch
from server.sessions.models import AttachedCollection, Session
from server.sessions.quotas import check_collection_count
from server.sessions.records import CollectionRecord

logger = logging.getLogger(__name__)

# Collection names are the memory store's ids (`longserve ingest --collection NAME`).
_COLLECTION_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CollectionAttachments:
    """The registry's collections: one per app. `lookup` finds (or restores) a session,
    `touch` marks it used."""

    def __init__(self, services: SessionServices, lookup: Lookup, touch: Touch) -> None:
        self.services = services
        self._lookup = lookup
        self._touch = touch

    def check_names(self, names: list[str], param: str) -> list[str]:
        """Valid, distinct names (in order), at most max_collections_per_session; 400 else."""
        for i, name in enumerate(names):
            if not _COLLECTION_NAME_RE.match(name):
                raise invalid_request(
                    f"Invalid collection name '{name[:64]}': use letters, digits, '.', '_' and "
                    "'-' (at most 128 characters, starting with a letter or digit).",
                    param=param.format(i=i),
                )
        unique = list(dict.fromkeys(names))
        limit = self.services.settings.max_collections_per_session
        if len(unique) > limit:
            raise invalid_request(
                f"A session can attach at most {limit} collections.", param=param.format(i=limit)
            )
        return unique

    async def attach(self, tenant: str, session_id: str, name: str) -> AttachedCollection:
        """Attach a collection (idempotent). The record is stored first, then the engine loads
        it; when the engine refuses (unknown collection 404, other fingerprint 409) the record
        goes again and the session is as it was."""
        services = self.services
        self.check_names([name], "name")
        session = await self._lookup(tenant, session_id)
        if name in session.collections:
            return session.collections[name]
        check_collection_count(services.settings, session)
        # A whole collection joins the memory where it stands: not in the middle of a document.
        if session.ingesting() and not await session.wait_idle(
            services.settings.session_wait_timeout_seconds
        ):
            raise session_busy(f"Session '{session_id}' is still reading documents.")
        attached = AttachedCollection(name, services.clock())
        if services.store is not None:
            await services.store.save_collection(tenant, session.id, attached.record())
        try:
            attached.attachment = await services.engine.attach_collection(session.engine_id, name)
        except BaseException:
            if services.store is not None:
                with contextlib.suppress(StoreError):
                    await services.store.delete_collection(tenant, session.id, name)
            raise
        session.collections[name] = attached
        self._touch(session)
        return attached

    async def reattach(self, session: Session, record: CollectionRecord) -> None:
        """Attach a stored collection to a restored session. A collection deleted or re-encoded
        since is left out (logged): the rest of the session still serves."""
        attached = AttachedCollection(record.name, record.attached_at)
        try:
            attached.attachment = await self.services.engine.attach_collection(
                session.engine_id, record.name
            )
        except (CollectionNotFound, CollectionIncompatible) as exc:
            logger.warning(
                "session %s: collection %s not restored: %s", session.id, record.name, exc
            )
            return
        session.collections[record.name] = attached
