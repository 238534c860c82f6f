"""Durable session records in the memory service, so that sessions survive restarts and any
replica can serve any session.

What is stored, per session (tenant T, id S), through `MemoryStoreClient`:

- under store session `T.S` (the engine's session id, `server.auth.tenant_session_id`, under
  which the engine writes its document manifests): the session record (document id `session`)
  and one record per document (document id `doc.<doc id>`: name, status, tokens, created_at,
  error);
- under store session `T.S.texts`: each document's extracted text (document id `<doc id>`).

Texts sit apart so that listing a session's document records never reads them. The engine keeps
the documents' encodings itself (content-addressed by model fingerprint and token chain hash), so
re-ingesting a stored text on another replica runs no model forward.

The memory service's client offers typed manifests but no generic record/blob API yet, so records
ride in a manifest's `meta` under a fingerprint of our own. This class is the only place that
knows; swapping to generic records changes nothing outside it.

One record per document (not one list in the session record) keeps two replicas that add
documents to one session at once from overwriting each other's.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from memory_store.backends import InvalidRequest, NotFound
from memory_store.client import MemoryStoreClient
from memory_store.encodings import DocumentManifest
from server.auth import tenant_session_id

RECORD_FINGERPRINT = "longserve-session-record"
SESSION_DOC = "session"
DOC_PREFIX = "doc."
RECORD_VERSION = 1

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
class SessionRecord:
    id: str
    tenant: str
    created_at: int
    ttl_seconds: int
    last_used: float
    memory: dict[str, Any] | None  # {"strategy", "params"} or None (the engine's default)
    metadata: dict[str, str] = field(default_factory=dict)
    documents: tuple[DocumentRecord, ...] = ()  # oldest first; filled in by `load`

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
            created_at=int(meta["created_at"]),
            ttl_seconds=int(meta["ttl_seconds"]),
            last_used=float(meta.get("last_used", meta["created_at"])),
            memory=dict(memory) if memory is not None else None,
            metadata={str(k): str(v) for k, v in (meta.get("metadata") or {}).items()},
        )

    def expired(self, now: float) -> bool:
        return now - self.last_used >= self.ttl_seconds


class SessionStore:
    """Session records and document texts in the memory service. Every method raises the
    store's errors (`StoreUnavailable`, ...) unchanged; the caller decides what they mean."""

    def __init__(self, client: MemoryStoreClient) -> None:
        self.client = client

    @staticmethod
    def _records_id(tenant: str, session_id: str) -> str:
        # The engine's own id of the session: its document manifests land beside the records,
        # and deleting the session deletes them too.
        return tenant_session_id(tenant, session_id)

    @staticmethod
    def _texts_id(tenant: str, session_id: str) -> str:
        return f"{tenant_session_id(tenant, session_id)}.texts"

    @staticmethod
    def _manifest(doc_id: str, name: str, meta: dict[str, Any]) -> DocumentManifest:
        return DocumentManifest(
            doc_id=doc_id,
            fingerprint=RECORD_FINGERPRINT,
            chunk_hashes=(),
            name=name,
            created_at=time.time(),
            meta=meta,
        )

    async def ping(self) -> None:
        await self.client.ping()

    async def save_session(self, record: SessionRecord) -> None:
        await self.client.put_manifest(
            self._records_id(record.tenant, record.id),
            SESSION_DOC,
            self._manifest(SESSION_DOC, record.id, record.to_meta()),
        )

    async def save_document(self, tenant: str, session_id: str, doc: DocumentRecord) -> None:
        doc_id = DOC_PREFIX + doc.id
        await self.client.put_manifest(
            self._records_id(tenant, session_id),
            doc_id,
            self._manifest(doc_id, doc.name, doc.to_meta()),
        )

    async def save_text(self, tenant: str, session_id: str, doc_id: str, text: str) -> None:
        await self.client.put_manifest(
            self._texts_id(tenant, session_id), doc_id, self._manifest(doc_id, "", {"text": text})
        )

    async def load_text(self, tenant: str, session_id: str, doc_id: str) -> str:
        manifest = await self.client.get_manifest(self._texts_id(tenant, session_id), doc_id)
        return str(manifest.meta["text"])

    async def load(self, tenant: str, session_id: str) -> SessionRecord | None:
        """The session with its documents, or None when the store holds no such session for
        this tenant."""
        if not storable_session_id(session_id):
            return None
        records_id = self._records_id(tenant, session_id)
        try:
            head = await self.client.get_manifest(records_id, SESSION_DOC)
        except NotFound:
            return None
        try:
            record = SessionRecord.from_meta(head.meta)
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"malformed session record for {records_id}: {e}") from e
        if record.tenant != tenant or record.id != session_id:
            return None
        documents = []
        for manifest in await self.client.list_documents(records_id):
            if manifest.fingerprint != RECORD_FINGERPRINT or not manifest.doc_id.startswith(
                DOC_PREFIX
            ):
                continue
            doc = DocumentRecord.from_meta(manifest.meta)
            if _DOCUMENT_ID_RE.match(doc.id):
                documents.append(doc)
        documents.sort(key=lambda d: (d.created_at, d.id))
        return SessionRecord(
            id=record.id,
            tenant=record.tenant,
            created_at=record.created_at,
            ttl_seconds=record.ttl_seconds,
            last_used=record.last_used,
            memory=record.memory,
            metadata=record.metadata,
            documents=tuple(documents),
        )

    async def delete(self, tenant: str, session_id: str) -> None:
        """The session record, its document records and texts (the record first: once it is
        gone no replica restores the session, whatever remains)."""
        await self.client.delete_session(self._records_id(tenant, session_id))
        await self.client.delete_session(self._texts_id(tenant, session_id))

    async def close(self) -> None:
        await self.client.close()
