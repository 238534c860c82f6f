"""Sessions and their documents: the per-tenant registry, background ingestion, TTL eviction.

A session lives in two places: here (owner, documents, TTL, quotas) and in the engine (its
memory, under `tenant_session_id(tenant, id)`). Each uploaded document becomes one asyncio task
that waits for the session's previous document, then streams `engine.ingest` progress into the
document's status (queued -> ingesting -> ready | failed). Deleting or evicting a session
cancels its tasks (which closes the engine's ingest iterators) and drops its engine memory.

Another tenant's session is indistinguishable from a missing one: every lookup is keyed by
(tenant, id) and answers 404 `session_not_found`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from fastapi import Request

from engine.protocol import EngineClient, EngineError, MemorySpec
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
    SessionCreateRequest,
    SessionDocument,
    SessionMemory,
    SessionObject,
)
from server.serving import until_disconnected
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

# How long a delete or an eviction waits for cancelled ingestion tasks to wind down.
CANCEL_GRACE_SECONDS = 5.0


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
class Session:
    id: str
    tenant: str
    created_at: int
    memory: MemorySpec | None
    ttl_seconds: int
    metadata: dict[str, str]
    last_used: float
    documents: dict[str, Document] = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        return tenant_session_id(self.tenant, self.id)

    @property
    def memory_tokens(self) -> int:
        return sum(doc.tokens_done for doc in self.documents.values())

    @property
    def pending_bytes(self) -> int:
        return sum(doc.size_bytes for doc in self.documents.values() if doc.text is not None)

    def ingesting(self) -> list[asyncio.Task[None]]:
        return [
            doc.task
            for doc in self.documents.values()
            if doc.task is not None and not doc.task.done()
        ]

    def view(self) -> SessionObject:
        memory = self.memory
        return SessionObject(
            id=self.id,
            created_at=self.created_at,
            memory=SessionMemory(
                strategy=memory.strategy if memory else None,
                params=dict(memory.params) if memory else {},
            ),
            ttl_seconds=self.ttl_seconds,
            expires_at=int(self.last_used + self.ttl_seconds),
            documents=len(self.documents),
            memory_tokens=self.memory_tokens,
            status="ingesting" if self.ingesting() else "ready",
            metadata=self.metadata,
        )


class SessionRegistry:
    """Every live session, by tenant. One per app; safe because everything runs on one loop."""

    def __init__(
        self,
        engine: EngineClient,
        settings: ServerSettings,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
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
        self._sweeper: asyncio.Task[None] | None = None

    # --- sessions -----------------------------------------------------------------------------

    def sessions(self, tenant: str) -> list[Session]:
        return list(self._by_tenant.get(tenant, {}).values())

    def get(self, tenant: str, session_id: str) -> Session:
        session = self._by_tenant.get(tenant, {}).get(session_id)
        if session is None:
            raise session_not_found(session_id)
        return session

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
            created_at=int(now),
            memory=memory,
            ttl_seconds=ttl,
            metadata=dict(body.metadata or {}),
            last_used=now,
        )
        self._creating[tenant] += 1
        # Shielded: once the engine holds the memory, the session is registered (and so swept
        # when its TTL passes) even if the client has gone away meanwhile.
        await asyncio.shield(self._create_in_engine(session))
        return session

    async def _create_in_engine(self, session: Session) -> None:
        try:
            await self.engine.create_session(session.engine_id, session.memory)
        finally:
            self._creating[session.tenant] -= 1
        self._by_tenant.setdefault(session.tenant, {})[session.id] = session
        logger.info("session %s created", session.engine_id)

    async def delete(self, tenant: str, session_id: str) -> None:
        session = self.get(tenant, session_id)
        await asyncio.shield(self._remove(session, "The session was deleted."))

    async def _remove(self, session: Session, reason: str) -> None:
        """Forget the session, cancel its ingestion, free its engine memory at once."""
        tenant_sessions = self._by_tenant.get(session.tenant, {})
        if tenant_sessions.get(session.id) is not session:
            return
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

    def tenant_memory_tokens(self, tenant: str) -> int:
        return sum(s.memory_tokens for s in self._by_tenant.get(tenant, {}).values())

    # --- documents ----------------------------------------------------------------------------

    def document(self, tenant: str, session_id: str, document_id: str) -> Document:
        doc = self.get(tenant, session_id).documents.get(document_id)
        if doc is None:
            raise document_not_found(document_id)
        return doc

    async def add_document(self, tenant: str, session_id: str, upload: Upload) -> Document:
        """Check, extract, queue. Any failure leaves the session exactly as it was."""
        self._check_room(self.get(tenant, session_id), 0)
        extracted = await self.reader.read(upload)
        session = self.get(tenant, session_id)  # it may have gone while we read
        size = len(extracted.text.encode("utf-8", "surrogatepass"))
        self._check_room(session, size)
        doc = Document(
            id=new_document_id(),
            session_id=session.id,
            name=extracted.name,
            created_at=int(self.clock()),
            size_bytes=size,
            text=extracted.text,
        )
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
            async for progress in iterator:
                last = progress
                doc.update(tokens_total=progress.tokens_total, tokens_done=progress.tokens_done)
                self._check_memory_budget(session, doc)
                if progress.done:
                    break
            if last is None or not last.done:
                raise EngineError("the engine stopped before reading the whole document")
            self.metrics.ingest_finished(last.tokens_total, last.seconds)
            doc.update(status="ready", text=None)
            self.touch(session)
        except asyncio.CancelledError:
            doc.update(status="failed", error=doc.error or "Ingestion was cancelled.", text=None)
            raise
        except Exception as exc:
            message = from_exception(exc).message
            logger.info("ingesting %s into %s failed: %s", doc.id, session.engine_id, message)
            doc.update(status="failed", error=message, text=None)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

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

        A session this registry does not know (one the engine holds for another reason) is left
        for the engine to judge: it raises SessionNotFound (404) when it holds no memory under
        the tenant-scoped id, so tenants stay apart either way.
        """
        session = self._by_tenant.get(tenant, {}).get(session_id)
        if session is None:
            return
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
        return [session.id for session in expired]

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
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)


def registry_of(request: Request) -> SessionRegistry:
    registry: SessionRegistry = request.app.state.sessions
    return registry
