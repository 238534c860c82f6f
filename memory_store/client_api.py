"""The memory service's API as an abstract class: what `InProcessMemoryStoreClient`
(client_inprocess.py) and `HttpMemoryStoreClient` (client_http.py) implement. Callers import it
from `memory_store.client`, which also makes the clients.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from memory_store.encodings import ChunkEncoding, ChunkRef, DocumentManifest, Quantization
from memory_store.larimar import LarimarHit
from memory_store.observed import RequestHook, observed
from memory_store.usage import UsageClaim

T = TypeVar("T")


class MemoryStoreClient(ABC):
    """The memory service's API. memory_store/client.py's `in_process_client`, `embedded_client`
    and `http_client` make one."""

    backend_name: str = "unknown"

    def __init__(self, on_request: RequestHook | None = None) -> None:
        self.on_request = on_request

    async def _observe(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        async with observed(self.on_request, op, self.backend_name):
            return await call()

    # The API ----------------------------------------------------------------------------------

    @abstractmethod
    async def ping(self) -> None:
        """Raises StoreUnavailableError when the store cannot be reached."""

    @abstractmethod
    async def put_chunk(
        self,
        fingerprint: str,
        chain_hash: str,
        chunk: ChunkEncoding,
        quantization: Quantization = "fp16",
    ) -> bool:
        """True if written, False if that chunk was already stored."""

    @abstractmethod
    async def has_chunk(self, fingerprint: str, chain_hash: str) -> bool: ...

    @abstractmethod
    async def get_chunk(self, fingerprint: str, chain_hash: str) -> ChunkEncoding: ...

    @abstractmethod
    async def put_manifest(
        self, session_id: str, doc_id: str, manifest: DocumentManifest
    ) -> None: ...

    @abstractmethod
    async def get_manifest(self, session_id: str, doc_id: str) -> DocumentManifest: ...

    @abstractmethod
    async def list_documents(self, session_id: str) -> list[DocumentManifest]: ...

    @abstractmethod
    async def delete_session(self, session_id: str) -> int: ...

    @abstractmethod
    async def add_to_collection(
        self, name: str, fingerprint: str, chain_hashes: Sequence[str], embeddings: np.ndarray
    ) -> int: ...

    @abstractmethod
    async def select_chunks(
        self, name: str, query_embedding: np.ndarray, top_k: int
    ) -> list[ChunkRef]: ...

    @abstractmethod
    async def collection_chunks(self, name: str) -> list[ChunkRef]:
        """Every chunk of the collection in document order (score 0); NotFound if none."""

    @abstractmethod
    async def delete_collection(self, name: str) -> int: ...

    # Generic records and blobs (memory_store/records.py) -----------------------------------

    @abstractmethod
    async def put_record(self, namespace: str, key: str, record: Mapping[str, Any]) -> None:
        """Store (or replace) a JSON object under `key` in `namespace` ("sess:ID", "tenant:ID")."""

    @abstractmethod
    async def get_record(self, namespace: str, key: str) -> dict[str, Any]:
        """Raises NotFound."""

    @abstractmethod
    async def list_records(self, namespace: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """The namespace's records whose key starts with `prefix`, by key."""

    @abstractmethod
    async def delete_record(self, namespace: str, key: str) -> bool: ...

    @abstractmethod
    async def put_blob(self, namespace: str, key: str, data: bytes) -> None: ...

    @abstractmethod
    async def get_blob(self, namespace: str, key: str) -> bytes:
        """Raises NotFound."""

    @abstractmethod
    async def larimar_write(
        self,
        session_id: str,
        *,
        text: str | None = None,
        segments: Sequence[str] | None = None,
        save: bool = False,
    ) -> int: ...

    @abstractmethod
    async def larimar_read(
        self, session_id: str, query: str, top_k: int = 3, use_prefix: bool = True
    ) -> list[LarimarHit]: ...

    @abstractmethod
    async def larimar_save(self, session_id: str) -> None: ...

    @abstractmethod
    async def larimar_load(self, session_id: str) -> dict[str, int]: ...

    # The per-tenant usage ledger (memory_store/usage.py) ----------------------------------------

    @abstractmethod
    async def claim_usage(
        self,
        tenant: str,
        item: str,
        amounts: Mapping[str, int],
        limits: Mapping[str, int] | None = None,
    ) -> UsageClaim:
        """Set `item`'s amounts in the tenant's ledger unless a growing total would pass its
        limit (then nothing changes and `refused` names the kind)."""

    @abstractmethod
    async def release_usage(self, tenant: str, item: str) -> dict[str, int]:
        """Drop `item` from the tenant's ledger; the totals after."""

    @abstractmethod
    async def usage(self, tenant: str) -> dict[str, int]:
        """The tenant's totals per kind (zero kinds left out)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # Reclamation (memory_store/reclaim.py) ----------------------------------------------------

    @abstractmethod
    async def delete_blob(self, namespace: str, key: str) -> bool: ...

    @abstractmethod
    async def drop_unnamed_chunks(
        self, session_id: str, fingerprint: str, hashes: Sequence[str]
    ) -> int:
        """A reading of `session_id` cut short: delete the chunks it put that nothing names
        (memory_store/reclaim.py); returns how many went."""

    @abstractmethod
    async def reclaim(self, chunk_grace_s: float | None = None) -> dict[str, int]:
        """Sweep: expired sessions, then chunks nothing names idle past `chunk_grace_s` (None:
        the store's default); returns what went (`ReclaimReport.to_record()`)."""
