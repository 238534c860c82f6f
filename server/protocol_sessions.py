"""longserve's extension of OpenAI's wire format: sessions and their documents and collections
(server/sessions/, routes/sessions.py), as pydantic models. Shaped like OpenAI's own objects: an
"object" tag, unix-second timestamps, lists as {"object": "list", "data": [...]}, deletes as
{"id", "object": "....deleted", "deleted"}. The chat, completion and response models are in
server/protocol.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from server.protocol import MemoryRequest, Metadata, OpenAIModel

DocumentStatus = Literal["queued", "ingesting", "ready", "failed"]


class SessionCreateRequest(OpenAIModel):
    memory: MemoryRequest | None = None
    ttl_seconds: int | None = Field(default=None, ge=1)
    metadata: Metadata = None
    collections: list[str] | None = None  # names to attach, as POST .../collections does


class SessionMemoryView(OpenAIModel):
    """A session's memory as the API shows it (the engine's memory itself is
    engine.memory.SessionMemory)."""

    strategy: str | None  # None: the engine's configured default strategy
    params: dict[str, Any] = Field(default_factory=dict)
    # "device": beside the model; "host": in host memory (idle sessions move there after
    # session_offload_after_seconds); "disk": memory blocks in the disk tier (memory knob
    # tier "disk", or past session_ram_bytes). None: kept in the memory service (larimar).
    tier: Literal["device", "host", "disk"] | None = None


class SessionObject(OpenAIModel):
    id: str
    object: Literal["session"] = "session"
    created_at: int
    memory: SessionMemoryView
    ttl_seconds: int
    expires_at: int
    documents: int
    turns: int = 0  # finished turns the memory holds
    memory_tokens: int  # documents, collections and turns
    status: Literal["ready", "ingesting"]
    metadata: dict[str, str] = Field(default_factory=dict)
    collections: list[str] = Field(default_factory=list)


class SessionList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[SessionObject]


class SessionDeleted(OpenAIModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


class DocumentCreateRequest(OpenAIModel):
    text: str
    name: str | None = None


class SessionDocument(OpenAIModel):
    id: str
    object: Literal["session.document"] = "session.document"
    session_id: str
    name: str
    status: DocumentStatus
    tokens: int | None = None
    progress: float = 0.0
    created_at: int
    error: str | None = None


class SessionDocumentList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[SessionDocument]


class CollectionAttachRequest(OpenAIModel):
    name: str


class SessionCollection(OpenAIModel):
    """A collection attached to a session. loading "whole": read into the session's memory when
    attached; "selected": too large for that, each request loads its top-k chunks by EmbQ."""

    name: str
    object: Literal["session.collection"] = "session.collection"
    session_id: str
    chunks: int | None = None  # None: not known on this replica yet
    tokens: int | None = None
    loading: Literal["whole", "selected"] | None = None
    attached_at: int


class SessionCollectionList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[SessionCollection]
