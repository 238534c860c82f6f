"""Sessions and their documents: the per-tenant registry, background ingestion, TTL eviction.

A session lives in two places: here (owner, documents, TTL, quotas) and in the engine (its
memory, under `tenant_session_id(tenant, id)`). Each uploaded document becomes one asyncio task
that waits for the session's previous document, then streams `engine.ingest` progress into the
document's status (queued -> ingesting -> ready | failed). Deleting or evicting a session
cancels its tasks (which closes the engine's ingest iterators) and drops its engine memory.

Another tenant's session is indistinguishable from a missing one: every lookup is keyed by
(tenant, id) and answers 404 `session_not_found`.

With a memory store (server/session_store.py) a session is also durable, so that it survives a
restart and any replica can serve it: creating it, uploading a document (its text) and a
document becoming ready each return only once the store holds the change. A request naming a
session this registry does not hold restores it from the store (once, however many requests
ask at the same time): a new engine memory, then the ready documents' texts ingested again in
order; the engine rebuilds them from their stored encodings without running the model. While the
store is down, held sessions keep serving chat; operations that need the store answer 503
`memory_store_unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from fastapi import Request

from engine.protocol import (
    CollectionAttachment,
    CollectionIncompatible,
    CollectionNotFound,
    EngineClient,
    EngineError,
    IngestProgress,
    MemorySpec,
    SessionMemoryInfo,
    StoreUnavailableError,
)
from memory_store.errors import InvalidStoreRequest, NotFound, StoreError
from server.auth import tenant_session_id
from server.documents import DocumentLimits, DocumentReader, Upload
from server.errors import (
    document_not_found,
    from_exception,
    invalid_request,
    limit_reached,
    session_busy,
    session_not_found,
)
from server.metrics import Metrics
from server.protocol import (
    DocumentStatus,
    SessionCollection,
    SessionCreateRequest,
    SessionDocument,
    SessionMemory,
    SessionObject,
)
from server.serving import until_disconnected
from server.session_store import (
    CollectionRecord,
    DocumentRecord,
    SessionRecord,
    SessionStore,
)
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

# How long a delete or an eviction waits for cancelled ingestion tasks to wind down.
CANCEL_GRACE_SECONDS = 5.0
# A document the engine has read becomes ready once its record is durable; these are the waits
# between tries while the store is down, after which the document is marked failed.
READY_SAVE_BACKOFF_SECONDS = (0.25, 0.5, 1.0, 2.0, 4.0)
# Collection names are the memory store's ids (`longserve ingest --collection NAME`).
_COLLECTION_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def new_session_id() -> str:
    return f"sess_{secrets.token_hex(16)}"


def new_document_id() -> str:
    return f"doc_{secrets.token_hex(16)}"


@dataclass(eq=False)
class Document:
    id: str
    session_id: str
    name: str
    created_at: int
    size_bytes: int
    text: str | None  # held until ingestion ends, then freed
    status: DocumentStatus = "queued"
    tokens_total: int | None = None
    tokens_done: int = 0  # what the engine's memory holds of it, even after a failure
    error: str | None = None
    task: asyncio.Task[None] | None = None
    uploaded_at: float = 0.0  # orders a session's documents in the store
    saved: bool = True  # False: ready here, but the store still says queued
    version: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.status in ("ready", "failed")

    def update(self, **changes: object) -> None:
        """Change fields and wake everyone watching this document."""
        for name, value in changes.items():
            setattr(self, name, value)
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_for_change(self, seen_version: int) -> None:
        while self.version == seen_version:
            await self._changed.wait()

    def record(self) -> DocumentRecord:
        return DocumentRecord(
            id=self.id,
            name=self.name,
            created_at=self.uploaded_at or float(self.created_at),
            status=self.status,
            tokens=self.tokens_total,
            error=self.error,
        )

    def view(self) -> SessionDocument:
        if self.status == "ready":
            progress = 1.0
        elif self.tokens_total:
            progress = round(min(1.0, self.tokens_done / self.tokens_total), 4)
        else:
            progress = 0.0
        return SessionDocument(
            id=self.id,
            session_id=self.session_id,
            name=self.name,
            status=self.status,
            tokens=self.tokens_total,
            progress=progress,
            created_at=self.created_at,
            error=self.error,
        )


@dataclass(eq=False)
class AttachedCollection:
    """A collection attached to a session. Collections are written by the operator
    (`longserve ingest`) and readable by every tenant; what is per tenant is the session."""

    name: str
    attached_at: float
    attachment: CollectionAttachment | None = None  # what the engine loaded (None: not yet)

    def record(self) -> CollectionRecord:
        return CollectionRecord(name=self.name, attached_at=self.attached_at)

    def view(self, session_id: str) -> SessionCollection:
        loaded = self.attachment
        return SessionCollection(
            name=self.name,
            session_id=session_id,
            chunks=loaded.chunks if loaded else None,
            tokens=loaded.tokens if loaded else None,
            loading=loaded.loading if loaded else None,
            attached_at=int(self.attached_at),
        )


@dataclass(eq=False)
class Session:
    id: str
    tenant: str
    created_at: float  # to the clock's precision: sessions created in one second keep their order
    memory: MemorySpec | None
    ttl_seconds: int
    metadata: dict[str, str]
    last_used: float
    documents: dict[str, Document] = field(default_factory=dict)
    collections: dict[str, AttachedCollection] = field(default_factory=dict)
    saved_last_used: float = 0.0  # last_used as the store holds it
    saving: asyncio.Task[None] | None = None  # a background save of last_used
    removed: bool = False

    @property
    def engine_id(self) -> str:
        return tenant_session_id(self.tenant, self.id)

    @property
    def memory_tokens(self) -> int:
        loaded = sum(
            c.attachment.tokens for c in self.collections.values() if c.attachment is not None
        )
        return loaded + sum(doc.tokens_done for doc in self.documents.values())

    @property
    def pending_bytes(self) -> int:
        return sum(doc.size_bytes for doc in self.documents.values() if doc.text is not None)

    def ingesting(self) -> list[asyncio.Task[None]]:
        return [
            doc.task
            for doc in self.documents.values()
            if doc.task is not None and not doc.task.done()
        ]

    def record(self) -> SessionRecord:
        memory = self.memory
        return SessionRecord(
            id=self.id,
            tenant=self.tenant,
            created_at=self.created_at,
            ttl_seconds=self.ttl_seconds,
            last_used=self.last_used,
            memory={"strategy": memory.strategy, "params": dict(memory.params)} if memory else None,
            metadata=dict(self.metadata),
        )

    def view(self, held: SessionMemoryInfo | None = None) -> SessionObject:
        """The API object; `held` is what the engine says of the session's memory now."""
        memory = self.memory
        return SessionObject(
            id=self.id,
            created_at=int(self.created_at),
            memory=SessionMemory(
                strategy=memory.strategy if memory else None,
                params=dict(memory.params) if memory else {},
                tier=held.tier if held else None,
            ),
            ttl_seconds=self.ttl_seconds,
            expires_at=int(self.last_used + self.ttl_seconds),
            documents=len(self.documents),
            memory_tokens=self.memory_tokens,
            status="ingesting" if self.ingesting() else "ready",
            metadata=self.metadata,
            collections=list(self.collections),
        )


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
            )
        )
        self._by_tenant: dict[str, dict[str, Session]] = {}
        self._creating: Counter[str] = Counter()
        self._restoring: dict[tuple[str, str], asyncio.Task[Session]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    # --- sessions -----------------------------------------------------------------------------

    def sessions(self, tenant: str) -> list[Session]:
        return list(self._by_tenant.get(tenant, {}).values())

    def view(self, session: Session) -> SessionObject:
        return session.view(self.engine.session_memory_info(session.engine_id))

    def get(self, tenant: str, session_id: str) -> Session:
        """A session this registry holds (no restore: see `lookup`)."""
        session = self._by_tenant.get(tenant, {}).get(session_id)
        if session is None:
            raise session_not_found(session_id)
        return session

    async def list_views(self, tenant: str) -> list[SessionObject]:
        """The tenant's sessions, oldest first: every one the store's tenant index names (held
        here or not: another replica's appear too), else, with no store or the store down,
        the ones this replica holds. Listing never restores a session (no engine work).

        A held session the index no longer names was deleted through another replica: it is
        let go here too. Index entries whose record is gone (a delete half done) or expired
        are skipped.
        """
        held = dict(self._by_tenant.get(tenant, {}))
        if self.store is None:
            return [self.view(s) for s in sorted(held.values(), key=_created)]
        try:
            ids = await self.store.session_ids(tenant)
            records = await asyncio.gather(
                *(self._load_listed(tenant, sid) for sid in ids if sid not in held)
            )
        except StoreError as exc:
            logger.info("listing sessions from the memory store failed (%s): held ones only", exc)
            return [self.view(s) for s in sorted(held.values(), key=_created)]
        indexed = set(ids)
        for session in held.values():
            if session.id not in indexed and await self._gone_from_store(session):
                await self._remove(session, "The session was deleted.")
        now = self.clock()
        still_held = self._by_tenant.get(tenant, {})
        dated = [(s.created_at, s.id, self.view(s)) for s in still_held.values()]
        dated += [
            (record.created_at, record.id, stored_view(record))
            for record in records
            if record is not None and not record.expired(now) and record.id not in still_held
        ]
        return [view for _, _, view in sorted(dated, key=lambda d: (d[0], d[1]))]

    async def _load_listed(self, tenant: str, session_id: str) -> SessionRecord | None:
        """A listed session's record; None (logged) for one that cannot be read back, so one
        bad record does not hide the others. An unreachable store still raises."""
        assert self.store is not None
        try:
            return await self.store.load(tenant, session_id)
        except InvalidStoreRequest as exc:
            logger.warning("session %s in the tenant index is unreadable: %s", session_id, exc)
            return None

    async def _gone_from_store(self, session: Session) -> bool:
        """True only when the store answers that the session's record is gone (deleted through
        another replica); a store that cannot answer keeps held sessions serving."""
        if self.store is None:
            return False
        try:
            return not await self.store.exists(session.tenant, session.id)
        except StoreError as exc:
            logger.debug("could not check session %s in the memory store: %s", session.id, exc)
            return False

    async def lookup(self, tenant: str, session_id: str) -> Session:
        """A held session (unless the store says it was deleted meanwhile), or one restored
        from the store; 404 when neither has it."""
        session = self._by_tenant.get(tenant, {}).get(session_id)
        if session is not None:
            if await self._gone_from_store(session):
                await self._remove(session, "The session was deleted.")
                raise session_not_found(session_id)
            return session
        if self.store is None:
            raise session_not_found(session_id)
        key = (tenant, session_id)
        task = self._restoring.get(key)
        if task is None:
            task = asyncio.create_task(
                self._restore(tenant, session_id), name=f"restore-{session_id}"
            )
            self._restoring[key] = task
            task.add_done_callback(lambda done: self._restore_finished(key, done))
        # Shielded: a restore others may be waiting on outlives the client that started it.
        return await asyncio.shield(task)

    def _restore_finished(self, key: tuple[str, str], task: asyncio.Task[Session]) -> None:
        if self._restoring.get(key) is task:
            del self._restoring[key]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have gone

    async def _restore(self, tenant: str, session_id: str) -> Session:
        assert self.store is not None
        record = await self.store.load(tenant, session_id)
        now = self.clock()
        if record is None:
            raise session_not_found(session_id)
        if record.expired(now):
            with contextlib.suppress(StoreError):
                await self.store.delete(tenant, session_id)
            raise session_not_found(session_id)
        memory = (
            MemorySpec(strategy=record.memory["strategy"], params=record.memory.get("params", {}))
            if record.memory
            else None
        )
        session = Session(
            id=record.id,
            tenant=tenant,
            created_at=record.created_at,
            memory=memory,
            ttl_seconds=record.ttl_seconds,
            metadata=dict(record.metadata),
            last_used=now,
            saved_last_used=record.last_used,
        )
        texts: dict[str, str] = {}
        for doc_record in record.documents:
            doc = Document(
                id=doc_record.id,
                session_id=session.id,
                name=doc_record.name,
                created_at=int(doc_record.created_at),
                uploaded_at=doc_record.created_at,
                size_bytes=0,
                text=None,
                status="failed" if doc_record.status == "failed" else "queued",
                tokens_total=doc_record.tokens,
                error=doc_record.error,
            )
            session.documents[doc.id] = doc
            if doc.status == "failed":
                continue
            try:
                texts[doc.id] = await self.store.load_text(tenant, session_id, doc.id)
            except NotFound:
                doc.update(status="failed", error="The document's text is no longer stored.")
        await self.engine.create_session(session.engine_id, memory)
        # Ready documents and attached collections, in the order they filled the memory.
        events: list[tuple[float, DocumentRecord | CollectionRecord]] = [
            (d.created_at, d) for d in record.documents
        ]
        events += [(c.attached_at, c) for c in record.collections]
        events.sort(key=lambda e: e[0])
        try:
            for _, event in events:
                if isinstance(event, CollectionRecord):
                    await self._reattach(session, event)
                    continue
                doc = session.documents[event.id]
                if event.status == "ready" and doc.id in texts:
                    await self._reingest(session, doc, texts.pop(doc.id))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.engine.drop_session(session.engine_id)
            raise
        held = self._by_tenant.setdefault(tenant, {})
        if session_id in held:  # cannot happen on one loop, but never hold two
            return held[session_id]
        held[session_id] = session
        # Documents the store holds but no replica finished reading (it crashed, or is still
        # reading them): read them here, in order, as if just uploaded.
        previous: asyncio.Task[None] | None = None
        for doc in session.documents.values():
            if doc.id in texts:
                doc.text = texts[doc.id]
                doc.size_bytes = len(doc.text.encode("utf-8", "surrogatepass"))
                doc.task = asyncio.create_task(
                    self._ingest(session, doc, previous), name=f"ingest-{doc.id}"
                )
                previous = doc.task
        logger.info(
            "session %s restored from the memory store (%d documents)",
            session.engine_id,
            len(session.documents),
        )
        return session

    async def _reattach(self, session: Session, record: CollectionRecord) -> None:
        """Attach a stored collection to a restored session. A collection deleted or re-encoded
        since is left out (logged): the rest of the session still serves."""
        attached = AttachedCollection(record.name, record.attached_at)
        try:
            attached.attachment = await self.engine.attach_collection(
                session.engine_id, record.name
            )
        except (CollectionNotFound, CollectionIncompatible) as exc:
            logger.warning(
                "session %s: collection %s not restored: %s", session.id, record.name, exc
            )
            return
        session.collections[record.name] = attached

    def check_collection_names(self, names: list[str], param: str) -> list[str]:
        """Valid, distinct names (in order), at most max_collections_per_session; 400 else."""
        for i, name in enumerate(names):
            if not _COLLECTION_NAME_RE.match(name):
                raise invalid_request(
                    f"Invalid collection name '{name[:64]}': use letters, digits, '.', '_' and "
                    "'-' (at most 128 characters, starting with a letter or digit).",
                    param=param.format(i=i),
                )
        unique = list(dict.fromkeys(names))
        limit = self.settings.max_collections_per_session
        if len(unique) > limit:
            raise invalid_request(
                f"A session can attach at most {limit} collections.", param=param.format(i=limit)
            )
        return unique

    async def attach_collection(
        self, tenant: str, session_id: str, name: str
    ) -> AttachedCollection:
        """Attach a collection (idempotent). The record is stored first, then the engine loads
        it; when the engine refuses (unknown collection 404, other fingerprint 409) the record
        goes again and the session is as it was."""
        self.check_collection_names([name], "name")
        session = await self.lookup(tenant, session_id)
        if name in session.collections:
            return session.collections[name]
        if len(session.collections) >= self.settings.max_collections_per_session:
            raise limit_reached(
                "collection_limit",
                f"The session already has {self.settings.max_collections_per_session} "
                "collections attached, the most allowed.",
            )
        # A whole collection joins the memory where it stands: not in the middle of a document.
        if session.ingesting() and not await self._wait_idle(
            session, self.settings.session_wait_timeout_seconds
        ):
            raise session_busy(f"Session '{session_id}' is still reading documents.")
        attached = AttachedCollection(name, self.clock())
        if self.store is not None:
            await self.store.save_collection(tenant, session.id, attached.record())
        try:
            attached.attachment = await self.engine.attach_collection(session.engine_id, name)
        except BaseException:
            if self.store is not None:
                with contextlib.suppress(StoreError):
                    await self.store.delete_collection(tenant, session.id, name)
            raise
        session.collections[name] = attached
        self.touch(session)
        return attached

    async def _reingest(self, session: Session, doc: Document, text: str) -> None:
        """Read a ready document into a restored session's memory, before anyone sees it."""
        # The upload's own request id: the engine names the document's manifest after it.
        iterator = self.engine.ingest(f"ingest-{doc.id}", session.engine_id, text)
        last: IngestProgress | None = None
        try:
            async for progress in iterator:
                last = progress
                if progress.done:
                    break
        except StoreUnavailableError as exc:  # read into memory all the same
            logger.warning("document %s restored, but not stored again: %s", doc.id, exc)
            if last is not None:
                last = dataclasses.replace(last, tokens_done=last.tokens_total, done=True)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        if last is None or not last.done:
            raise EngineError("the engine stopped before reading the whole document")
        self._count_ingest(last)
        doc.update(status="ready", tokens_total=last.tokens_total, tokens_done=last.tokens_done)

    def _count_ingest(self, progress: IngestProgress) -> None:
        """ingest_tokens_total counts what the model ran over, not what the store gave back."""
        ran = max(0, progress.tokens_done - progress.tokens_from_store)
        self.metrics.ingest_finished(ran, progress.seconds)

    async def create(self, tenant: str, body: SessionCreateRequest) -> Session:
        settings = self.settings
        ttl = body.ttl_seconds or settings.default_session_ttl_seconds
        if ttl > settings.max_session_ttl_seconds:
            raise invalid_request(
                f"ttl_seconds must be at most {settings.max_session_ttl_seconds}, got {ttl}.",
                param="ttl_seconds",
            )
        held = len(self._by_tenant.get(tenant, {})) + self._creating[tenant]
        if held >= settings.max_sessions_per_tenant:
            raise limit_reached(
                "session_limit",
                f"This API key already holds {settings.max_sessions_per_tenant} sessions, the "
                "most allowed; delete one (DELETE /v1/sessions/{id}) first.",
            )
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
        names = self.check_collection_names(body.collections or [], "collections[{i}]")
        self._creating[tenant] += 1
        # Shielded: once the engine holds the memory, the session is registered (and so swept
        # when its TTL passes) even if the client has gone away meanwhile.
        await asyncio.shield(self._create_in_engine(session))
        try:
            for name in names:
                await self.attach_collection(tenant, session.id, name)
        except BaseException:
            # A collection that cannot be attached fails the whole create: no session is left.
            if self.store is not None:
                with contextlib.suppress(StoreError):
                    await asyncio.shield(self._delete_everywhere(tenant, session.id, session))
            await asyncio.shield(self._remove(session, "The session could not be created."))
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
        finally:
            self._creating[session.tenant] -= 1
        self._by_tenant.setdefault(session.tenant, {})[session.id] = session
        logger.info("session %s created", session.engine_id)

    async def delete(self, tenant: str, session_id: str) -> None:
        """Forget the session here and in the store. With the store down: 503, and the session
        stays (this replica, if it held it, lets it go; the next request restores it)."""
        session = self._by_tenant.get(tenant, {}).get(session_id)
        if self.store is None:
            if session is None:
                raise session_not_found(session_id)
            await asyncio.shield(self._remove(session, "The session was deleted."))
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
            await self._remove(session, "The session was deleted.")
            if session.saving is not None:
                await asyncio.wait([session.saving])
        await self.store.delete(tenant, session_id)

    async def _remove(self, session: Session, reason: str) -> None:
        """Forget the session, cancel its ingestion, free its engine memory at once."""
        tenant_sessions = self._by_tenant.get(session.tenant, {})
        if tenant_sessions.get(session.id) is not session:
            return
        session.removed = True
        del tenant_sessions[session.id]
        if not tenant_sessions:
            self._by_tenant.pop(session.tenant, None)
        tasks = self._cancel_ingestion(session.documents.values(), reason)
        try:
            await self.engine.drop_session(session.engine_id)
        except EngineError as exc:
            logger.warning("dropping session %s failed: %r", session.engine_id, exc)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)
        logger.info("session %s removed: %s", session.engine_id, reason)

    @staticmethod
    def _cancel_ingestion(documents: Iterable[Document], reason: str) -> list[asyncio.Task[None]]:
        tasks = []
        for doc in documents:
            if doc.task is not None and not doc.task.done():
                doc.error = reason
                doc.task.cancel()
                tasks.append(doc.task)
        return tasks

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

    def tenant_memory_tokens(self, tenant: str) -> int:
        return sum(s.memory_tokens for s in self._by_tenant.get(tenant, {}).values())

    # --- documents ----------------------------------------------------------------------------

    async def document(self, tenant: str, session_id: str, document_id: str) -> Document:
        doc = (await self.lookup(tenant, session_id)).documents.get(document_id)
        if doc is None:
            raise document_not_found(document_id)
        return doc

    async def add_document(self, tenant: str, session_id: str, upload: Upload) -> Document:
        """Check, extract, save (with a store), queue. Any failure leaves the session exactly
        as it was."""
        self._check_room(await self.lookup(tenant, session_id), 0)
        extracted = await self.reader.read(upload)
        session = self.get(tenant, session_id)  # it may have gone while we read
        size = len(extracted.text.encode("utf-8", "surrogatepass"))
        self._check_room(session, size)
        now = self.clock()
        doc = Document(
            id=new_document_id(),
            session_id=session.id,
            name=extracted.name,
            created_at=int(now),
            uploaded_at=now,
            size_bytes=size,
            text=extracted.text,
        )
        if self.store is not None:
            # The text first: a document record always has its text to be read again from.
            await self.store.save_text(tenant, session.id, doc.id, extracted.text)
            await self.store.save_document(tenant, session.id, doc.record())
            session = self.get(tenant, session_id)  # it may have gone while we saved
            self._check_room(session, size)
        previous = [d.task for d in session.documents.values() if d.task is not None]
        session.documents[doc.id] = doc
        doc.task = asyncio.create_task(
            self._ingest(session, doc, previous[-1] if previous else None),
            name=f"ingest-{doc.id}",
        )
        self.touch(session)
        return doc

    def _check_room(self, session: Session, size_bytes: int) -> None:
        settings = self.settings
        if len(session.documents) >= settings.max_documents_per_session:
            raise limit_reached(
                "document_limit",
                f"The session already holds {settings.max_documents_per_session} documents, "
                "the most allowed; start a new session.",
            )
        used = self.tenant_memory_tokens(session.tenant)
        if used >= settings.max_memory_tokens_per_tenant:
            raise limit_reached(
                "memory_limit",
                f"This API key's sessions hold {used} memory tokens, the most allowed is "
                f"{settings.max_memory_tokens_per_tenant}; delete a session first.",
            )
        pending = sum(s.pending_bytes for s in self.sessions(session.tenant))
        if pending + size_bytes > settings.max_pending_document_bytes_per_tenant:
            raise limit_reached(
                "ingest_queue_full",
                f"{pending} bytes of this API key's documents are still waiting to be read; "
                "retry when they are ready.",
            )

    async def _ingest(
        self, session: Session, doc: Document, previous: asyncio.Task[None] | None
    ) -> None:
        iterator = None
        try:
            if previous is not None:
                await asyncio.wait([previous])  # in order; its failure is not ours
            doc.update(status="ingesting")
            assert doc.text is not None
            iterator = self.engine.ingest(f"ingest-{doc.id}", session.engine_id, doc.text)
            last = None
            durable = True
            try:
                async for progress in iterator:
                    last = progress
                    doc.update(tokens_total=progress.tokens_total, tokens_done=progress.tokens_done)
                    self._check_memory_budget(session, doc)
                    if progress.done:
                        break
            except StoreUnavailableError as exc:
                # The memory holds the whole document, only its encodings are not stored: ready
                # here; the store keeps it `queued` (with its text) for a replica to read again.
                logger.warning("document %s read, but not stored: %s", doc.id, exc)
                durable = False
                if last is not None:
                    last = dataclasses.replace(last, tokens_done=last.tokens_total, done=True)
            if last is None or not last.done:
                raise EngineError("the engine stopped before reading the whole document")
            self._count_ingest(last)
            if durable:
                durable = await self._save_ready(session, doc)
            doc.saved = durable
            doc.update(status="ready", text=None)
            self.touch(session)
        except asyncio.CancelledError:
            doc.update(status="failed", error=doc.error or "Ingestion was cancelled.", text=None)
            raise
        except Exception as exc:
            message = from_exception(exc).message
            logger.info("ingesting %s into %s failed: %s", doc.id, session.engine_id, message)
            doc.update(status="failed", error=message, text=None)
            await self._save_failed(session, doc)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _save_ready(self, session: Session, doc: Document) -> bool:
        """Make the document's `ready` durable, trying a while if the store is down. False if
        it stayed down: the document is ready here all the same (the memory holds it), and the
        session's next background save tries again."""
        if self.store is None:
            return True
        record = dataclasses.replace(doc.record(), status="ready", error=None)
        for delay in (*READY_SAVE_BACKOFF_SECONDS, None):
            try:
                await self.store.save_document(session.tenant, session.id, record)
                return True
            except StoreError as exc:
                if delay is None:
                    logger.warning("document %s is ready but not saved: %s", doc.id, exc)
                    return False
                logger.info("saving document %s failed (%s); retrying", doc.id, exc)
                await asyncio.sleep(delay)
        return False

    async def _save_failed(self, session: Session, doc: Document) -> None:
        """Best effort: a replica restoring the session then does not read it again."""
        if self.store is None or session.removed:
            return
        try:
            await self.store.save_document(session.tenant, session.id, doc.record())
        except StoreError as exc:
            logger.info("saving failed document %s to the memory store failed: %s", doc.id, exc)

    def _check_memory_budget(self, session: Session, doc: Document) -> None:
        limit = self.settings.max_memory_tokens_per_tenant
        others = self.tenant_memory_tokens(session.tenant) - doc.tokens_done
        needed = doc.tokens_total or 0
        if others + needed > limit:
            raise limit_reached(
                "memory_limit",
                f"The document has {needed} tokens; this API key's sessions already hold "
                f"{others} of the {limit} memory tokens allowed.",
            )

    async def watch(self, doc: Document) -> AsyncIterator[SessionDocument]:
        """The document now, then after every change, until it is ready or failed. A slow
        reader sees the latest state, not every intermediate one."""
        while True:
            seen = doc.version
            yield doc.view()
            if doc.finished:
                return
            await doc.wait_for_change(seen)

    # --- chat ---------------------------------------------------------------------------------

    async def before_generate(self, tenant: str, session_id: str, request: Request) -> None:
        """Mark the session used; wait for (or refuse, per session_busy_policy) its ingestion.

        A session this registry does not hold is restored from the store when there is one
        (404 if the store has none for this tenant). Without a store it is left for the engine
        to judge: it raises SessionNotFound (404) when it holds no memory under the
        tenant-scoped id, so tenants stay apart either way.
        """
        if self.store is None and session_id not in self._by_tenant.get(tenant, {}):
            return
        session = await self.lookup(tenant, session_id)
        self.touch(session)
        if not session.ingesting():
            return
        settings = self.settings
        if settings.session_busy_policy == "reject":
            raise session_busy(
                f"Session '{session_id}' is still reading documents; retry when every document "
                "is ready (GET /v1/sessions/{id}/documents?stream=true follows progress)."
            )
        timeout = settings.session_wait_timeout_seconds
        idle = await until_disconnected(request, self._wait_idle(session, timeout))
        if self._by_tenant.get(tenant, {}).get(session_id) is not session:
            raise session_not_found(session_id)
        if not idle:
            raise session_busy(
                f"Session '{session_id}' was still reading documents after {timeout:g} seconds."
            )
        self.touch(session)

    @staticmethod
    async def _wait_idle(session: Session, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while tasks := session.ingesting():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.wait(tasks, timeout=remaining)
        return True

    # --- TTL ----------------------------------------------------------------------------------

    async def sweep(self) -> list[str]:
        """Evict sessions idle past their TTL (a session still reading documents is busy, not
        idle). Returns the evicted ids."""
        now = self.clock()
        expired = [
            session
            for sessions in self._by_tenant.values()
            for session in sessions.values()
            if not session.ingesting() and now - session.last_used >= session.ttl_seconds
        ]
        for session in expired:
            await self._remove(session, "The session expired.")
            await self._forget_if_expired(session)
        return [session.id for session in expired]

    async def _forget_if_expired(self, session: Session) -> None:
        """Delete an evicted session from the store too, unless another replica has used it
        since (its stored last_used says so)."""
        if self.store is None:
            return
        try:
            if session.saving is not None:
                await asyncio.wait([session.saving])
            record = await self.store.load(session.tenant, session.id)
            if record is None or record.expired(self.clock()):
                await self.store.delete(session.tenant, session.id)
        except StoreError as exc:
            logger.info("forgetting expired session %s failed: %s", session.id, exc)

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="session-sweeper")

    async def _sweep_forever(self) -> None:
        interval = self.settings.session_sweep_interval_seconds
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except Exception:
                logger.exception("session sweep failed")

    async def close(self) -> None:
        """Stop sweeping and cancel ingestion; the engine's shutdown frees the memories."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        documents = [
            doc
            for sessions in self._by_tenant.values()
            for session in sessions.values()
            for doc in session.documents.values()
        ]
        tasks = self._cancel_ingestion(documents, "The server is shutting down.")
        for sessions in self._by_tenant.values():
            for session in sessions.values():
                if session.saving is not None and not session.saving.done():
                    session.saving.cancel()
                    tasks.append(session.saving)
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)


def _created(session: Session) -> tuple[float, str]:
    return session.created_at, session.id


def stored_view(record: SessionRecord) -> SessionObject:
    """A session another replica holds (or none does), as its stored record describes it."""
    memory = record.memory
    busy = any(d.status in ("queued", "ingesting") for d in record.documents)
    return SessionObject(
        id=record.id,
        created_at=int(record.created_at),
        memory=SessionMemory(
            strategy=memory["strategy"] if memory else None,
            params=dict(memory.get("params", {})) if memory else {},
        ),
        ttl_seconds=record.ttl_seconds,
        expires_at=int(record.last_used + record.ttl_seconds),
        documents=len(record.documents),
        memory_tokens=sum(d.tokens or 0 for d in record.documents if d.status == "ready"),
        status="ingesting" if busy else "ready",
        metadata=dict(record.metadata),
        collections=[c.name for c in record.collections],
    )


def registry_of(request: Request) -> SessionRegistry:
    registry: SessionRegistry = request.app.state.sessions
    return registry
