"""The typed async client the engine and the server use to reach the memory service.

`MemoryStoreClient` is the API; two implementations sit behind it:

- `MemoryStoreClient.in_process(backend)` (`client_inprocess.py`): wraps the store over a
  backend in this process (the embedded default; also works over Redis without the HTTP hop).
  `MemoryStoreClient.embedded(data_dir)` is that over an `EmbeddedBackend` at `data_dir`.
- `MemoryStoreClient.http(base_url)` (`client_http.py`): httpx to a remote `longserve
  memory-store`, with bounded retries and backoff; a restarted service is picked up on the next
  call.

Both raise the same exception tree (`memory_store.errors.StoreError` and children) and report
every call to an optional `on_request(op, backend, status, seconds)` hook, which the server turns
into `longserve:memory_store_requests_total` (this module never imports prometheus_client).

server/ and engine/ import only this module and `memory_store.errors`, so the types they exchange
with the store are re-exported here.
"""

from __future__ import annotations

import asyncio
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from memory_store.backends import Backend, EmbeddedBackend
from memory_store.embedder import Embedder, TextEncoder, bundled_model_path
from memory_store.encodings import (
    ChunkEncoding,
    ChunkRef,
    DocumentManifest,
    Quantization,
    chain_hash,
)
from memory_store.errors import StoreUnavailableError
from memory_store.keys import KeySpace
from memory_store.larimar import LarimarConfig, LarimarHit, split_sentences
from memory_store.observed import RequestHook, observed
from memory_store.retry import RetryPolicy

__all__ = [
    "Backend",
    "ChunkEncoding",
    "ChunkRef",
    "DocumentManifest",
    "KeySpace",
    "LarimarConfig",
    "LarimarHit",
    "MemoryStoreClient",
    "Quantization",
    "RequestHook",
    "RetryPolicy",
    "TextEncoder",
    "bundled_model_path",
    "chain_hash",
    "default_embedder",
    "split_sentences",
    "wait_until_ready",
]

T = TypeVar("T")


def default_embedder() -> Embedder:
    """The process-wide sentence encoder, looked up in `memory_store.embedder` at each call."""
    from memory_store import embedder

    return embedder.default_embedder()


class MemoryStoreClient(ABC):
    """The memory service's API. Use `in_process(...)`, `embedded(...)` or `http(...)` to get one."""

    backend_name: str = "unknown"

    def __init__(self, on_request: RequestHook | None = None) -> None:
        self.on_request = on_request

    @staticmethod
    def in_process(
        backend: Backend,
        *,
        encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
        larimar: LarimarConfig | None = None,
        on_request: RequestHook | None = None,
    ) -> MemoryStoreClient:
        from memory_store.client_inprocess import InProcessMemoryStoreClient

        return InProcessMemoryStoreClient(
            backend, encoder=encoder, larimar=larimar, on_request=on_request
        )

    @staticmethod
    def embedded(
        data_dir: str | os.PathLike[str],
        *,
        encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
        larimar: LarimarConfig | None = None,
        on_request: RequestHook | None = None,
    ) -> MemoryStoreClient:
        """The in-process client over an `EmbeddedBackend` at `data_dir` (created if missing)."""
        return MemoryStoreClient.in_process(
            EmbeddedBackend(data_dir), encoder=encoder, larimar=larimar, on_request=on_request
        )

    @staticmethod
    def http(
        base_url: str,
        *,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        on_request: RequestHook | None = None,
        transport: Any = None,
    ) -> MemoryStoreClient:
        from memory_store.client_http import HttpMemoryStoreClient

        return HttpMemoryStoreClient(
            base_url, timeout_s=timeout_s, retry=retry, on_request=on_request, transport=transport
        )

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

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


async def wait_until_ready(client: MemoryStoreClient, timeout_s: float = 10.0) -> None:
    """Poll `ping` until it succeeds or `timeout_s` passes (then re-raise StoreUnavailableError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.ping()
            return
        except StoreUnavailableError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)
