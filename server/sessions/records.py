"""Durable session records in the memory service, so that sessions survive restarts and any
replica can serve any session.

What is stored, through the memory store's generic records and blobs
(`MemoryStoreClient.put_record` / `put_blob`):

- in namespace `sess:T.S` (tenant T, session S; `T.S` is the engine's session id,
  `server.auth.tenant_session_id`, so these share the hash tag `{sess:T.S}` with the document
  manifests the engine writes, and one `delete_session` removes them all): the session record
  (key `session`), one record per document (`doc.<doc id>`: name, status, tokens, created_at,
  error), one per attached collection (`coll.<name>`: name, attached_at), and each document's
  extracted text as a blob (`text.<doc id>`; blobs are never read by a listing);
- in namespace `tenant:T`: the tenant's index, one record per session (key S), so that any
  replica can list a tenant's sessions without scanning the store.

The engine keeps the documents' encodings itself (content-addressed by model fingerprint and
token chain hash), so re-ingesting a stored text on another replica runs no model forward.

One record per document, per attachment and per index entry (not one list in a record) keeps
two replicas that change one session, or one tenant, at once from overwriting each other.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import SessionTurn
from memory_store.client import KeySpace, MemoryStoreClient
from memory_store.errors import InvalidStoreRequest, NotFound, StoreError
from server.auth import tenant_session_id

SESSION_KEY = "session"
DOC_PREFIX = "doc."
COLLECTION_PREFIX = "coll."
TEXT_PREFIX = "text."
TURN_PREFIX = "turn."  # + seq, zero-padded: a finished request's turn (record)
TURN_KV_PREFIX = "turnkv."  # + seq: its encodings (blob), written before the record
RECORD_VERSION = 2

# Only ids this server hands out are looked up in the store (anything else cannot be there, and
# must not reach the store's key validation).
_SESSION_ID_RE = re.compile(r"^sess_[0-9a-f]{32}$")
_DOCUMENT_ID_RE = re.compile(r"^doc_[0-9a-f]{32}$")


def storable_session_id(session_id: str) -> bool:
    return bool(_SESSION_ID_RE.match(session_id))


@dataclass(frozen=True)
class DocumentRecord:
    id: str
    name: str
    created_at: float
    status: str
    tokens: int | None = None
    error: str | None = None

    def to_meta(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "status": self.status,
            "tokens": self.tokens,
            "error": self.error,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> DocumentRecord:
        tokens = meta.get("tokens")
        return cls(
            id=str(meta["id"]),
            name=str(meta.get("name", "")),
            created_at=float(meta.get("created_at", 0.0)),
            status=str(meta.get("status", "queued")),
            tokens=int(tokens) if tokens is not None else None,
            error=meta.get("error"),
        )


@dataclass(frozen=True)
class CollectionRecord:
    """A collection attached to a session; replayed in `attached_at` order with the documents
    when the session is restored, so the memory is rebuilt in the order it was filled."""

    name: str
    attached_at: float

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "attached_at": self.attached_at}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> CollectionRecord:
        return cls(name=str(meta["name"]), attached_at=float(meta.get("attached_at", 0.0)))


@dataclass(frozen=True)
class TurnRecord:
    """A turn a session took (engine.protocol.SessionTurn, its encodings apart: they are the
    blob `turnkv.<seq>`), and when its request started: turns are replayed after the documents
    uploaded before it."""

    at: float
    turn: SessionTurn
    encoded: bool = True  # its encodings were stored (the blob may still be gone)

    @property
    def seq(self) -> int:
        return self.turn.seq

    def to_meta(self) -> dict[str, Any]:
        meta = dataclasses.asdict(dataclasses.replace(self.turn, encoding=None))
        del meta["encoding"]
        encoded = self.encoded and self.turn.encoding is not None
        return {"at": self.at, "encoded": encoded, **meta}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> TurnRecord:
        messages = meta.get("messages")
        turn = SessionTurn(
            seq=int(meta["seq"]),
            restart=bool(meta["restart"]),
            messages=None if messages is None else [(str(r), str(t)) for r, t in messages],
            answer=str(meta["answer"]),
            token_ids=[int(t) for t in meta["token_ids"]],
            commits=[int(c) for c in meta["commits"]],
            hash_before=meta.get("hash_before"),
            hash_after=meta.get("hash_after"),
            turns=int(meta["turns"]),
            turn_tokens=int(meta["turn_tokens"]),
        )
        return cls(at=float(meta["at"]), turn=turn, encoded=bool(meta.get("encoded")))


class TurnConflict(StoreError):
    """Another replica stored a different turn under the same seq."""


def turn_key(seq: int) -> str:
    return f"{TURN_PREFIX}{seq:010d}"


@dataclass(frozen=True)
class SessionRecord:
    id: str
    tenant: str
    created_at: float  # unix seconds, sub-second precision (listing order)
    ttl_seconds: int
    last_used: float
    memory: dict[str, Any] | None  # {"strategy", "params"} or None (the engine's default)
    metadata: dict[str, str] = field(default_factory=dict)
    documents: tuple[DocumentRecord, ...] = ()  # oldest first; filled in by `load`
    collections: tuple[CollectionRecord, ...] = ()  # oldest first; filled in by `load`
    turns: tuple[TurnRecord, ...] = ()  # by seq, encodings not loaded; filled in by `load`

    def to_meta(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "id": self.id,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "ttl_seconds": self.ttl_seconds,
            "last_used": self.last_used,
            "memory": self.memory,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> SessionRecord:
        memory = meta.get("memory")
        return cls(
            id=str(meta["id"]),
            tenant=str(meta["tenant"]),
            created_at=float(meta["created_at"]),
            ttl_seconds=int(meta["ttl_seconds"]),
            last_used=float(meta.get("last_used", meta["created_at"])),
            memory=dict(memory) if memory is not None else None,
            metadata={str(k): str(v) for k, v in (meta.get("metadata") or {}).items()},
        )

    def expired(self, now: float) -> bool:
        return now - self.last_used >= self.ttl_seconds


class SessionStore:
    """Session records, document texts and the per-tenant index in the memory service. Every
    method raises the store's errors (`StoreUnavailableError`, ...) unchanged; the caller decides
    what they mean."""

    def __init__(self, client: MemoryStoreClient) -> None:
        self.client = client

    @staticmethod
    def _namespace(tenant: str, session_id: str) -> str:
        return f"{KeySpace.SESSION}:{tenant_session_id(tenant, session_id)}"

    @staticmethod
    def _index(tenant: str) -> str:
        return f"tenant:{tenant}"

    async def ping(self) -> None:
        await self.client.ping()

    async def save_session(self, record: SessionRecord, *, new: bool = False) -> None:
        """Store the session record; `new` also enters it in the tenant's index (after the
        record: an index entry whose record is missing is skipped, never the reverse)."""
        await self.client.put_record(
            self._namespace(record.tenant, record.id), SESSION_KEY, record.to_meta()
        )
        if new:
            await self.client.put_record(
                self._index(record.tenant),
                record.id,
                {"id": record.id, "created_at": record.created_at},
            )

    async def save_document(self, tenant: str, session_id: str, doc: DocumentRecord) -> None:
        await self.client.put_record(
            self._namespace(tenant, session_id), DOC_PREFIX + doc.id, doc.to_meta()
        )

    async def save_collection(
        self, tenant: str, session_id: str, collection: CollectionRecord
    ) -> None:
        await self.client.put_record(
            self._namespace(tenant, session_id),
            COLLECTION_PREFIX + collection.name,
            collection.to_meta(),
        )

    async def delete_collection(self, tenant: str, session_id: str, name: str) -> None:
        await self.client.delete_record(
            self._namespace(tenant, session_id), COLLECTION_PREFIX + name
        )

    async def save_text(self, tenant: str, session_id: str, doc_id: str, text: str) -> None:
        await self.client.put_blob(
            self._namespace(tenant, session_id),
            TEXT_PREFIX + doc_id,
            text.encode("utf-8", "surrogatepass"),
        )

    async def save_turn(self, tenant: str, session_id: str, record: TurnRecord) -> None:
        """The turn's encodings, then its record: a record is never there without them.
        TurnConflict when another replica stored a different turn under its seq (this one
        was taken on a stale copy of the session). The check and the write are two calls:
        session affinity keeps two replicas off one session, this catches what slips by."""
        namespace = self._namespace(tenant, session_id)
        key = turn_key(record.seq)
        try:
            held = await self.client.get_record(namespace, key)
        except NotFound:
            held = None
        if held is not None:
            if held.get("hash_after") == record.turn.hash_after:
                return  # this very turn, stored by an earlier try
            raise TurnConflict(f"turn {record.seq} of session {session_id} was taken elsewhere")
        if record.turn.encoding is not None:
            await self.client.put_blob(namespace, TURN_KV_PREFIX + key, record.turn.encoding)
        await self.client.put_record(namespace, key, record.to_meta())

    async def has_turn(self, tenant: str, session_id: str, seq: int) -> bool:
        """Whether the store holds turn `seq` (a held copy at seq - 1 is then stale)."""
        try:
            await self.client.get_record(self._namespace(tenant, session_id), turn_key(seq))
        except NotFound:
            return False
        return True

    async def load_turn_encoding(self, tenant: str, session_id: str, seq: int) -> bytes | None:
        """A stored turn's encodings; None when they are gone."""
        namespace = self._namespace(tenant, session_id)
        try:
            return await self.client.get_blob(namespace, TURN_KV_PREFIX + turn_key(seq))
        except NotFound:
            return None

    async def load_text(self, tenant: str, session_id: str, doc_id: str) -> str:
        data = await self.client.get_blob(self._namespace(tenant, session_id), TEXT_PREFIX + doc_id)
        return data.decode("utf-8", "surrogatepass")

    async def exists(self, tenant: str, session_id: str) -> bool:
        """Whether the store still holds the session (another replica may have deleted it)."""
        if not storable_session_id(session_id):
            return False
        try:
            await self.client.get_record(self._namespace(tenant, session_id), SESSION_KEY)
        except NotFound:
            return False
        return True

    async def session_ids(self, tenant: str) -> list[str]:
        """The tenant's indexed sessions (some may have expired or be half-deleted: `load`
        each to know)."""
        index = await self.client.list_records(self._index(tenant))
        return [sid for sid in index if storable_session_id(sid)]

    async def load(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The session with its documents and collections, or None when the store holds no
        such session for this tenant."""
        if not storable_session_id(session_id):
            return None
        namespace = self._namespace(tenant, session_id)
        records = await self.client.list_records(namespace)
        head = records.get(SESSION_KEY)
        if head is None:
            return None
        try:
            record = SessionRecord.from_meta(head)
            if record.tenant != tenant or record.id != session_id:
                return None
            documents = [
                DocumentRecord.from_meta(meta)
                for key, meta in records.items()
                if key.startswith(DOC_PREFIX)
            ]
            collections = [
                CollectionRecord.from_meta(meta)
                for key, meta in records.items()
                if key.startswith(COLLECTION_PREFIX)
            ]
            turns = [
                TurnRecord.from_meta(meta)
                for key, meta in records.items()
                if key.startswith(TURN_PREFIX)
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidStoreRequest(f"malformed session record in {namespace}: {e}") from e
        documents = [d for d in documents if _DOCUMENT_ID_RE.match(d.id)]
        documents.sort(key=lambda d: (d.created_at, d.id))
        collections.sort(key=lambda c: (c.attached_at, c.name))
        turns.sort(key=lambda t: t.seq)
        return dataclasses.replace(
            record, documents=tuple(documents), collections=tuple(collections), turns=tuple(turns)
        )

    async def delete(self, tenant: str, session_id: str) -> None:
        """The session's records, texts and manifests, then its index entry (the records
        first: once they are gone no replica restores or lists the session, whatever
        remains), then its count in the tenant's usage ledger. Every path that deletes a
        stored session (DELETE, expiry, a sweep) goes through here."""
        await self.client.delete_session(tenant_session_id(tenant, session_id))
        await self.client.delete_record(self._index(tenant), session_id)
        await self.client.release_usage(tenant, session_id)

    async def close(self) -> None:
        await self.client.close()
