"""A session's documents: upload, background ingestion, progress.

Each uploaded document becomes one asyncio task that waits for the session's previous
document, then streams `engine.ingest` progress into the document's status (queued ->
ingesting -> ready | failed). With a memory store, uploading returns once the store holds the
text and the record, and a document becomes ready once its record says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from engine.protocol import EngineError, IngestProgress, StoreUnavailableError
from memory_store.errors import StoreError
from server.documents import Upload
from server.error_mapping import from_exception
from server.errors import document_not_found
from server.extraction import DocumentReader
from server.metrics import Metrics
from server.protocol_sessions import SessionDocument
from server.sessions.context import HeldSessions, Lookup, SessionServices, Touch
from server.sessions.models import Document, Session, new_document_id
from server.sessions.quotas import check_document_room, check_memory_budget

logger = logging.getLogger(__name__)

# A document the engine has read becomes ready once its record is durable; these are the waits
# between tries while the store is down, after which the document is marked failed.
READY_SAVE_BACKOFF_SECONDS = (0.25, 0.5, 1.0, 2.0, 4.0)


class DocumentIngestion:
    """The registry's documents: one per app. `held` is the registry's table of sessions,
    `lookup` finds (or restores) a session, `touch` marks it used."""

    def __init__(
        self,
        services: SessionServices,
        held: HeldSessions,
        metrics: Metrics,
        reader: DocumentReader,
        lookup: Lookup,
        touch: Touch,
    ) -> None:
        self.services = services
        self._held = held
        self._metrics = metrics
        self._reader = reader
        self._lookup = lookup
        self._touch = touch

    async def get(self, tenant: str, session_id: str, document_id: str) -> Document:
        doc = (await self._lookup(tenant, session_id)).documents.get(document_id)
        if doc is None:
            raise document_not_found(document_id)
        return doc

    async def add(self, tenant: str, session_id: str, upload: Upload) -> Document:
        """Check, extract, save (with a store), queue. Any failure leaves the session exactly
        as it was."""
        services = self.services
        self._check_room(await self._lookup(tenant, session_id), 0)
        ledger = await services.usage.totals(tenant)  # the tenant's other replicas
        self._check_room(self._held.get(tenant, session_id), 0, ledger)
        extracted = await self._reader.read(upload, tenant)
        session = self._held.get(tenant, session_id)  # it may have gone while we read
        size = len(extracted.text.encode("utf-8", "surrogatepass"))
        self._check_room(session, size)
        now = services.clock()
        doc = Document(
            id=new_document_id(),
            session_id=session.id,
            name=extracted.name,
            created_at=int(now),
            uploaded_at=now,
            size_bytes=size,
            text=extracted.text,
        )
        if services.store is not None:
            # The text first: a document record always has its text to be read again from.
            await services.store.save_text(tenant, session.id, doc.id, extracted.text)
            await services.store.save_document(tenant, session.id, doc.record())
            session = self._held.get(tenant, session_id)  # it may have gone while we saved
            self._check_room(session, size)
        previous = [d.task for d in session.documents.values() if d.task is not None]
        session.documents[doc.id] = doc
        doc.task = asyncio.create_task(
            self.ingest(session, doc, previous[-1] if previous else None),
            name=f"ingest-{doc.id}",
        )
        self._touch(session)
        await services.usage.update(session)
        return doc

    def _check_room(
        self, session: Session, size_bytes: int, ledger: dict[str, int] | None = None
    ) -> None:
        tenant_sessions = self._held.of(session.tenant)
        check_document_room(self.services.settings, session, tenant_sessions, size_bytes, ledger)

    async def ingest(
        self, session: Session, doc: Document, previous: asyncio.Task[None] | None
    ) -> None:
        """Read `doc` into the session's memory once `previous` (its predecessor) is done."""
        services = self.services
        iterator = None
        try:
            if previous is not None:
                await asyncio.wait([previous])  # in order; its failure is not ours
            doc.update(status="ingesting")
            assert doc.text is not None
            iterator = services.engine.ingest(f"ingest-{doc.id}", session.engine_id, doc.text)
            last = None
            durable = True
            reserved = False
            try:
                async for progress in iterator:
                    last = progress
                    doc.update(tokens_total=progress.tokens_total, tokens_done=progress.tokens_done)
                    check_memory_budget(services.settings, doc, self._held.of(session.tenant))
                    if not reserved and doc.tokens_total is not None:
                        reserved = True
                        await self._reserve(session, doc.tokens_total - doc.tokens_done)
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
            self.count_ingest(last)
            if durable:
                durable = await self._save_ready(session, doc)
            doc.saved = durable
            await services.usage.update(session)  # counted before any client sees it ready
            doc.update(status="ready", text=None)
            self._touch(session)
        except asyncio.CancelledError:
            doc.update(status="failed", error=doc.error or "Ingestion was cancelled.", text=None)
            raise
        except Exception as exc:
            message = from_exception(exc).message
            logger.info("ingesting %s into %s failed: %s", doc.id, session.engine_id, message)
            doc.update(status="failed", error=message, text=None)
            await self._save_failed(session, doc)
            await services.usage.update(session)  # its reservation given back
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _reserve(self, session: Session, tokens: int) -> None:
        """Count the whole document's `tokens` in the tenant's ledger before they are read:
        memory_limit (the document fails) past the budget of every replica. A ledger that
        cannot answer leaves the local check alone, as a store that is down leaves the read."""
        try:
            await self.services.usage.claim(session, tokens)
        except StoreError as exc:
            logger.info("document of session %s not counted in the ledger: %s", session.id, exc)

    def count_ingest(self, progress: IngestProgress) -> None:
        """ingest_tokens_total counts what the model ran over, not what the store gave back."""
        ran = max(0, progress.tokens_done - progress.tokens_from_store)
        self._metrics.ingest_finished(ran, progress.seconds)

    async def _save_ready(self, session: Session, doc: Document) -> bool:
        """Make the document's `ready` durable, trying a while if the store is down. False if
        it stayed down: the document is ready here all the same (the memory holds it), and the
        session's next background save tries again."""
        store = self.services.store
        if store is None:
            return True
        record = dataclasses.replace(doc.record(), status="ready", error=None)
        for delay in (*READY_SAVE_BACKOFF_SECONDS, None):
            try:
                await store.save_document(session.tenant, session.id, record)
                return True
            except StoreError as exc:
                if delay is None:
                    logger.warning("document %s is ready but not saved: %s", doc.id, exc)
                    return False
                logger.info("saving document %s failed (%s); retrying", doc.id, exc)
                await asyncio.sleep(delay)
        return False

    async def _save_failed(self, session: Session, doc: Document) -> None:
        """Best effort: a replica restoring the session then does not read it again, and the
        text nothing reads again goes (after the record: a record never lacks its text unless
        it says failed)."""
        store = self.services.store
        if store is None or session.removed:
            return
        try:
            await store.save_document(session.tenant, session.id, doc.record())
            await store.delete_text(session.tenant, session.id, doc.id)
        except StoreError as exc:
            logger.info("saving failed document %s to the memory store failed: %s", doc.id, exc)

    @staticmethod
    async def watch(doc: Document) -> AsyncIterator[SessionDocument]:
        """The document now, then after every change, until it is ready or failed. A slow
        reader sees the latest state, not every intermediate one."""
        while True:
            seen = doc.version
            yield doc.view()
            if doc.finished:
                return
            await doc.wait_for_change(seen)
