"""SessionRegistry: every live session, by tenant, and what creates, finds, uses and removes
them. Documents (ingestion.py), collections (attachments.py), restores (restore.py) and
TTL eviction (sweeper.py) are its collaborators; the limits are in quotas.py, the listing of a
tenant's sessions across replicas in listing.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from fastapi import Request

from engine.protocol import EngineClient, EngineError, MemorySpec, SessionTurn
from memory_store.errors import StoreError
from server.disconnect import until_disconnected
from server.documents import DocumentLimits
from server.errors import invalid_request, session_busy, session_not_found
from server.extraction import DocumentReader, ExtractionLimits, cpu_seconds_for
from server.metrics import Metrics
from server.protocol_sessions import SessionCreateRequest, SessionObject
from server.sessions.attachments import CollectionAttachments
from server.sessions.context import HeldSessions, SessionServices
from server.sessions.ingestion import DocumentIngestion
from server.sessions.listing import gone_from_store, list_session_views
from server.sessions.models import Document, Session, new_session_id
from server.sessions.quotas import check_session_count
from server.sessions.records import SessionStore
from server.sessions.restore import SessionRestorer
from server.sessions.sweeper import SessionSweeper
from server.sessions.turns import memory_room, record_turns, stale
from server.sessions.usage import SessionUsage
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

# How long a delete or an eviction waits for cancelled ingestion tasks to wind down.
CANCEL_GRACE_SECONDS = 5.0


class SessionRegistry:
    """Every live session, by tenant. One per app; safe because everything runs on one loop."""

    def __init__(
        self,
        engine: EngineClient,
        settings: ServerSettings,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        store: SessionStore | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self.store = store
        self.reader = DocumentReader(
            DocumentLimits(
                max_bytes=settings.max_document_bytes,
                max_chars=settings.max_document_chars,
                max_pdf_pages=settings.max_pdf_pages,
                timeout_seconds=settings.document_extract_timeout_seconds,
            ),
            ExtractionLimits(
                slots=settings.document_extract_slots,
                slots_per_tenant=settings.document_extract_slots_per_tenant,
                queue_seconds=settings.document_extract_queue_seconds,
                cpu_seconds=settings.document_extract_cpu_seconds
                or cpu_seconds_for(settings.document_extract_timeout_seconds),
                memory_bytes=settings.document_extract_memory_bytes or None,
                nice=settings.background_nice,
            ),
        )
        # the helpers get the services and the table, never the registry; the clock is read
        # through it at each call (a test may replace it)
        self.usage = SessionUsage(store, settings, metrics.tenant_usage)
        services = SessionServices(engine, settings, store, lambda: self.clock(), self.usage)
        self._held = HeldSessions()
        self.documents = DocumentIngestion(
            services, self._held, metrics, self.reader, self.lookup, self.touch
        )
        self.collections = CollectionAttachments(services, self.lookup, self.touch)
        self.restorer = SessionRestorer(services, self._held, self.documents, self.collections)
        self.sweeper = SessionSweeper(
            services, self._held, self.remove, metrics.memory_store_reclaimed_report
        )
        self._creating: Counter[str] = Counter()

    # --- held sessions ------------------------------------------------------------------------

    def sessions(self, tenant: str) -> list[Session]:
        return self._held.of(tenant)

    def all_sessions(self) -> list[Session]:
        return self._held.all()

    def held(self, tenant: str, session_id: str) -> Session | None:
        return self._held.find(tenant, session_id)

    def hold(self, session: Session) -> Session:
        """Register `session`; a session already held under its id stays (never hold two)."""
        return self._held.hold(session)

    def view(self, session: Session) -> SessionObject:
        return session.view(self.engine.session_memory_info(session.engine_id))

    def get(self, tenant: str, session_id: str) -> Session:
        """A session this registry holds (no restore: see `lookup`)."""
        return self._held.get(tenant, session_id)

    async def list_views(self, tenant: str) -> list[SessionObject]:
        """The tenant's sessions, oldest first (listing.py)."""
        return await list_session_views(
            self.store, self._held, tenant, self.view, self.remove, self.clock
        )

    async def memory_room(self, tenant: str) -> int:
        """How many tokens the tenant's sessions, on every replica, may still add to their
        memories (this replica's count alone when the ledger cannot answer)."""
        room = memory_room(self.settings.max_memory_tokens_per_tenant, self.sessions(tenant))
        try:
            ledger = await self.usage.totals(tenant)
        except StoreError:
            return room
        return min(
            room, self.settings.max_memory_tokens_per_tenant - ledger.get("memory_tokens", 0)
        )

    async def record_turns(self, session: Session, turns: Sequence[SessionTurn], at: float) -> None:
        """Count and store the turns a finished request carried out (turns.py)."""
        await record_turns(self.store, self.remove, session, turns, at)
        await self.usage.update(session)  # its turns' tokens, for every replica's budget

    # --- finding ------------------------------------------------------------------

    async def lookup(self, tenant: str, session_id: str) -> Session:
        """A held session (unless the store says it was deleted meanwhile), or one restored
        from the store; 404 when neither has it."""
        session = self.held(tenant, session_id)
        if session is not None:
            if await self.gone_from_store(session):
                await self.remove(session, "The session was deleted.")
                raise session_not_found(session_id)
            if not await stale(self.store, session):
                return session
            # another replica took turns on it meanwhile: this copy is behind, restore
            await self.remove(session, "another replica took turns on it")
        if self.store is None:
            raise session_not_found(session_id)
        return await self.restorer.restore(tenant, session_id)

    async def gone_from_store(self, session: Session) -> bool:
        """True only when the store answers that the session's record is gone (deleted through
        another replica); a store that cannot answer keeps held sessions serving."""
        return await gone_from_store(self.store, session)

    # --- creating and removing ----------------------------------------------------------------

    async def create(self, tenant: str, body: SessionCreateRequest) -> Session:
        settings = self.settings
        ttl = body.ttl_seconds or settings.default_session_ttl_seconds
        if ttl > settings.max_session_ttl_seconds:
            raise invalid_request(
                f"ttl_seconds must be at most {settings.max_session_ttl_seconds}, got {ttl}.",
                param="ttl_seconds",
            )
        if self.store is None:  # else the ledger counts every replica's (a held copy may be stale)
            check_session_count(settings, len(self.sessions(tenant)) + self._creating[tenant])
        memory = (
            MemorySpec(strategy=body.memory.strategy, params=body.memory.knobs())
            if body.memory
            else None
        )
        now = self.clock()
        session = Session(
            id=new_session_id(),
            tenant=tenant,
            created_at=now,
            memory=memory,
            ttl_seconds=ttl,
            metadata=dict(body.metadata or {}),
            last_used=now,
        )
        names = self.collections.check_names(body.collections or [], "collections[{i}]")
        await self.usage.claim(session)  # the tenant's sessions on every replica (429)
        self._creating[tenant] += 1
        # Shielded: once the engine holds the memory, the session is registered (and so swept
        # when its TTL passes) even if the client has gone away meanwhile.
        await asyncio.shield(self._create_in_engine(session))
        try:
            for name in names:
                await self.collections.attach(tenant, session.id, name)
        except BaseException:
            # A collection that cannot be attached fails the whole create: no session is left.
            if self.store is not None:
                with contextlib.suppress(StoreError):
                    await asyncio.shield(self._delete_everywhere(tenant, session.id, session))
            await asyncio.shield(self.remove(session, "The session could not be created."))
            raise
        return session

    async def _create_in_engine(self, session: Session) -> None:
        try:
            await self.engine.create_session(session.engine_id, session.memory)
            if self.store is not None:
                try:
                    await self.store.save_session(session.record(), new=True)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await self.engine.drop_session(session.engine_id)
                    raise
                session.saved_last_used = session.last_used
        except BaseException:
            with contextlib.suppress(StoreError):  # a refused create leaves no count behind
                await self.usage.release(session.tenant, session.id)
            raise
        finally:
            self._creating[session.tenant] -= 1
        self.hold(session)
        logger.info("session %s created", session.engine_id)

    async def delete(self, tenant: str, session_id: str) -> None:
        """Forget the session here and in the store. With the store down: 503, and the session
        stays (this replica, if it held it, lets it go; the next request restores it)."""
        session = self.held(tenant, session_id)
        if self.store is None:
            if session is None:
                raise session_not_found(session_id)
            await asyncio.shield(self.remove(session, "The session was deleted."))
            return
        await self.store.ping()
        if session is None and await self.store.load(tenant, session_id) is None:
            raise session_not_found(session_id)
        await asyncio.shield(self._delete_everywhere(tenant, session_id, session))

    async def _delete_everywhere(
        self, tenant: str, session_id: str, session: Session | None
    ) -> None:
        assert self.store is not None
        if session is not None:
            # Locally first: once ingestion has stopped, nothing writes the records again.
            await self.remove(session, "The session was deleted.")
            if session.saving is not None:
                await asyncio.wait([session.saving])
        await self.store.delete(tenant, session_id)

    async def remove(self, session: Session, reason: str) -> None:
        """Forget the session, cancel its ingestion, free its engine memory at once."""
        if not self._held.release(session):
            return
        session.removed = True
        tasks = _cancel_ingestion(session.documents.values(), reason)
        try:
            await self.engine.drop_session(session.engine_id)
        except EngineError as exc:
            logger.warning("dropping session %s failed: %r", session.engine_id, exc)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)
        logger.info("session %s removed: %s", session.engine_id, reason)

    # --- use ----------------------------------------------------------------------------------

    def touch(self, session: Session) -> None:
        session.last_used = self.clock()
        self._save_last_used(session)

    def _save_last_used(self, session: Session) -> None:
        """Keep the stored last_used roughly current (so that another replica neither restores
        an expired session nor drops a live one); best effort, in the background."""
        if self.store is None or session.removed:
            return
        if session.saving is not None and not session.saving.done():
            return
        unsaved = any(not doc.saved for doc in session.documents.values())
        if not unsaved and session.last_used - session.saved_last_used < session.ttl_seconds / 4:
            return
        session.saving = asyncio.create_task(
            self._save_session_quietly(session), name=f"save-{session.id}"
        )

    async def _save_session_quietly(self, session: Session) -> None:
        assert self.store is not None
        record = session.record()
        try:
            await self.store.save_session(record)
            session.saved_last_used = record.last_used
            for doc in list(session.documents.values()):
                if not doc.saved and not session.removed:
                    await self.store.save_document(session.tenant, session.id, doc.record())
                    doc.saved = True
        except StoreError as exc:
            logger.info("saving session %s to the memory store failed: %s", session.id, exc)

    async def before_generate(
        self, tenant: str, session_id: str, request: Request
    ) -> Session | None:
        """Mark the session used; wait for (or refuse, per session_busy_policy) its ingestion.

        A session this registry does not hold is restored from the store when there is one
        (404 if the store has none for this tenant). Without a store it is left for the engine
        to judge: it raises SessionNotFound (404) when it holds no memory under the
        tenant-scoped id, so tenants stay apart either way.
        """
        if self.store is None and self.held(tenant, session_id) is None:
            return None
        session = await self.lookup(tenant, session_id)
        self.touch(session)
        if not session.ingesting():
            return session
        settings = self.settings
        if settings.session_busy_policy == "reject":
            raise session_busy(
                f"Session '{session_id}' is still reading documents; retry when every document "
                "is ready (GET /v1/sessions/{id}/documents?stream=true follows progress)."
            )
        timeout = settings.session_wait_timeout_seconds
        idle = await until_disconnected(request, session.wait_idle(timeout))
        if self.held(tenant, session_id) is not session:
            raise session_not_found(session_id)
        if not idle:
            raise session_busy(
                f"Session '{session_id}' was still reading documents after {timeout:g} seconds."
            )
        self.touch(session)
        return session

    # --- lifetime -----------------------------------------------------------------------------

    def start(self) -> None:
        self.sweeper.start()

    async def close(self) -> None:
        """Stop sweeping, extracting and ingesting; the engine's shutdown frees the memories."""
        await self.sweeper.stop()
        self.reader.close()
        sessions = self.all_sessions()
        documents = [doc for session in sessions for doc in session.documents.values()]
        tasks = _cancel_ingestion(documents, "The server is shutting down.")
        for session in sessions:
            if session.saving is not None and not session.saving.done():
                session.saving.cancel()
                tasks.append(session.saving)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)


def _cancel_ingestion(documents: Iterable[Document], reason: str) -> list[asyncio.Task[None]]:
    tasks = []
    for doc in documents:
        if doc.task is not None and not doc.task.done():
            doc.error = reason
            doc.task.cancel()
            tasks.append(doc.task)
    return tasks
