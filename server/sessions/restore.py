"""Restoring a session from the memory store, so that any replica can serve it.

A request naming a session the registry does not hold restores it from the store (once,
however many requests ask at the same time): a new engine memory, then the ready documents'
texts ingested again in order; the engine rebuilds them from their stored encodings without
running the model. Documents the store holds but no replica finished reading are read again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from engine.protocol import (
    EngineError,
    IngestProgress,
    InvalidRequest,
    MemorySpec,
    StoreUnavailableError,
)
from memory_store.errors import NotFound, StoreError
from server.errors import session_not_found
from server.sessions.attachments import CollectionAttachments
from server.sessions.context import HeldSessions, SessionServices
from server.sessions.ingestion import DocumentIngestion
from server.sessions.models import Document, Session
from server.sessions.records import CollectionRecord, DocumentRecord, TurnRecord

logger = logging.getLogger(__name__)


class SessionRestorer:
    """The registry's restores in flight, one per (tenant, session id)."""

    def __init__(
        self,
        services: SessionServices,
        held: HeldSessions,
        documents: DocumentIngestion,
        collections: CollectionAttachments,
    ) -> None:
        self.services = services
        self._held = held
        self._documents = documents  # reads a restored session's documents again
        self._collections = collections  # attaches its collections again
        self._restoring: dict[tuple[str, str], asyncio.Task[Session]] = {}

    async def restore(self, tenant: str, session_id: str) -> Session:
        """The session as the store holds it, now held by the registry; 404 if the store has
        none for this tenant (or it expired)."""
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
        services = self.services
        store = services.store
        assert store is not None
        record = await store.load(tenant, session_id)
        now = services.clock()
        if record is None:
            raise session_not_found(session_id)
        if record.expired(now):
            with contextlib.suppress(StoreError):
                await store.delete(tenant, session_id)
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
                texts[doc.id] = await store.load_text(tenant, session_id, doc.id)
            except NotFound:
                doc.update(status="failed", error="The document's text is no longer stored.")
                continue
            doc.size_bytes = len(texts[doc.id].encode("utf-8", "surrogatepass"))
        # Within the tenant's limits across replicas before the engine holds anything: a
        # session already counted is granted as it is, one the ledger lacks must fit (429).
        ready = [d for d in record.documents if d.status == "ready"]
        restored_tokens = sum(d.tokens or 0 for d in ready)
        restored_tokens += record.turns[-1].turn.turn_tokens if record.turns else 0
        await services.usage.claim(session, restored_tokens)
        await services.engine.create_session(session.engine_id, memory)
        # Ready documents, attached collections and turns, in the order they filled the memory.
        events: list[tuple[float, DocumentRecord | CollectionRecord | TurnRecord]] = [
            (d.created_at, d) for d in record.documents
        ]
        events += [(c.attached_at, c) for c in record.collections]
        events += [(t.at, t) for t in record.turns]
        events.sort(key=lambda e: e[0])  # stable: a turn after what was uploaded before it
        try:
            for _, event in events:
                if isinstance(event, CollectionRecord):
                    await self._collections.reattach(session, event)
                    continue
                if isinstance(event, TurnRecord):
                    await self._replay_turn(session, event)
                    continue
                doc = session.documents[event.id]
                if event.status == "ready" and doc.id in texts:
                    await self._reingest(session, doc, texts.pop(doc.id))
        except BaseException:
            with contextlib.suppress(Exception):
                await services.engine.drop_session(session.engine_id)
            raise
        held = self._held.hold(session)
        if held is not session:  # cannot happen on one loop, but never hold two
            return held
        # Documents the store holds but no replica finished reading (it crashed, or is still
        # reading them): read them here, in order, as if just uploaded.
        previous: asyncio.Task[None] | None = None
        for doc in session.documents.values():
            if doc.id in texts:
                doc.text = texts[doc.id]
                doc.size_bytes = len(doc.text.encode("utf-8", "surrogatepass"))
                doc.task = asyncio.create_task(
                    self._documents.ingest(session, doc, previous), name=f"ingest-{doc.id}"
                )
                previous = doc.task
        logger.info(
            "session %s restored from the memory store (%d documents)",
            session.engine_id,
            len(session.documents),
        )
        return session

    async def _replay_turn(self, session: Session, record: TurnRecord) -> None:
        """A stored turn back into the restored session's memory: from its encodings (no
        model forward), else by reading its tokens again. A turn that does not follow what
        the memory holds (one before it was lost) is skipped; a later new chat starts from
        the documents again."""
        store = self.services.store
        assert store is not None
        encoding = None
        if record.encoded:
            encoding = await store.load_turn_encoding(session.tenant, session.id, record.seq)
        turn = dataclasses.replace(record.turn, encoding=encoding)
        try:
            await self.services.engine.import_turn(session.engine_id, turn)
        except InvalidRequest as exc:
            logger.warning("turn %d of session %s not restored: %s", turn.seq, session.id, exc)
            return
        session.hold_turn(turn)

    async def _reingest(self, session: Session, doc: Document, text: str) -> None:
        """Read a ready document into a restored session's memory, before anyone sees it."""
        # The upload's own request id: the engine names the document's manifest after it.
        iterator = self.services.engine.ingest(f"ingest-{doc.id}", session.engine_id, text)
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
        self._documents.count_ingest(last)
        doc.update(status="ready", tokens_total=last.tokens_total, tokens_done=last.tokens_done)
