"""What the registry holds: sessions, their documents and attached collections, with their
store records and API views."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.protocol import CollectionAttachment, MemorySpec, SessionMemoryInfo, SessionTurn
from server.auth import tenant_session_id
from server.protocol_sessions import (
    DocumentStatus,
    SessionCollection,
    SessionDocument,
    SessionMemoryView,
    SessionObject,
)
from server.sessions.records import CollectionRecord, DocumentRecord, SessionRecord, TurnRecord


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
    turns: int = 0  # finished turns the memory holds, and their tokens
    turn_tokens: int = 0
    seq: int = 0  # the last turn taken
    unsaved: list[TurnRecord] = field(default_factory=list)  # taken, not yet in the store
    turn_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def take_turns(self, turns: Sequence[SessionTurn], at: float) -> None:
        """Turns a finished request carried out: counted, and queued for the store."""
        for turn in turns:
            if turn.seq <= self.seq:
                continue  # seen already
            self.hold_turn(turn)
            self.unsaved.append(TurnRecord(at=at, turn=turn))

    def hold_turn(self, turn: SessionTurn) -> None:
        """The memory holds `turn` now: the counts are the ones it reported."""
        self.seq, self.turns, self.turn_tokens = turn.seq, turn.turns, turn.turn_tokens

    @property
    def engine_id(self) -> str:
        return tenant_session_id(self.tenant, self.id)

    @property
    def memory_tokens(self) -> int:
        loaded = sum(
            c.attachment.tokens for c in self.collections.values() if c.attachment is not None
        )
        read = sum(doc.tokens_done for doc in self.documents.values())
        return loaded + read + self.turn_tokens

    @property
    def pending_bytes(self) -> int:
        return sum(doc.size_bytes for doc in self.documents.values() if doc.text is not None)

    def ingesting(self) -> list[asyncio.Task[None]]:
        return [
            doc.task
            for doc in self.documents.values()
            if doc.task is not None and not doc.task.done()
        ]

    def reading(self) -> bool:
        return any(d.status in ("queued", "ingesting") for d in self.documents.values())

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` for every document to be read; False if some still are."""
        deadline = time.monotonic() + timeout
        while tasks := self.ingesting():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.wait(tasks, timeout=remaining)
        return True

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
            memory=SessionMemoryView(
                strategy=memory.strategy if memory else None,
                params=dict(memory.params) if memory else {},
                tier=held.tier if held else None,
            ),
            ttl_seconds=self.ttl_seconds,
            expires_at=int(self.last_used + self.ttl_seconds),
            documents=len(self.documents),
            turns=self.turns,
            memory_tokens=self.memory_tokens,
            # from the documents' own statuses, as stored_view: a task finishing its bookkeeping
            # after its document says ready must not make the session say ingesting
            status="ingesting" if self.reading() else "ready",
            metadata=self.metadata,
            collections=list(self.collections),
        )


def stored_view(record: SessionRecord) -> SessionObject:
    """A session another replica holds (or none does), as its stored record describes it."""
    memory = record.memory
    busy = any(d.status in ("queued", "ingesting") for d in record.documents)
    last = record.turns[-1].turn if record.turns else None
    return SessionObject(
        id=record.id,
        created_at=int(record.created_at),
        memory=SessionMemoryView(
            strategy=memory["strategy"] if memory else None,
            params=dict(memory.get("params", {})) if memory else {},
        ),
        ttl_seconds=record.ttl_seconds,
        expires_at=int(record.last_used + record.ttl_seconds),
        documents=len(record.documents),
        turns=last.turns if last else 0,
        memory_tokens=sum(d.tokens or 0 for d in record.documents if d.status == "ready")
        + (last.turn_tokens if last else 0),
        status="ingesting" if busy else "ready",
        metadata=dict(record.metadata),
        collections=[c.name for c in record.collections],
    )
