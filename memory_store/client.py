"""The typed async client the engine and the server use to reach the memory service.

`MemoryStoreClient` is the API; two implementations sit behind it:

- `MemoryStoreClient.in_process(backend)`: wraps the store over a backend in this process (the
  embedded default; also works over Redis without the HTTP hop).
- `MemoryStoreClient.http(base_url)`: httpx to a remote `longserve memory-store`, with bounded
  retries and backoff; a restarted service is picked up on the next call.

Both raise the same exception tree (`memory_store.backends.StoreError` and children) and report
every call to an optional `on_request(op, backend, status, seconds)` hook, which the server turns
into `longserve:memory_store_requests_total` (this module never imports prometheus_client).
"""

from __future__ import annotations

import asyncio
import base64
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from memory_store.backends import Backend, KeySpace, RetryPolicy, retrying
from memory_store.embedder import TextEncoder
from memory_store.encodings import (
    ChunkEncoding,
    ChunkRef,
    DocumentManifest,
    EncodingStore,
    Quantization,
    decode_chunk,
    embeddings_to_bytes,
    encode_chunk,
)
from memory_store.errors import (
    Conflict,
    InvalidStoreRequest,
    NotFound,
    StoreError,
    StoreUnavailableError,
    status_label,
)
from memory_store.larimar import LarimarConfig, LarimarHit, LarimarStore
from memory_store.records import RecordStore

T = TypeVar("T")

RequestHook = Callable[[str, str, str, float], None]
"""on_request(op, backend, status, seconds); status is "ok", "not_found", "unavailable", ..."""


class MemoryStoreClient(ABC):
    """The memory service's API. Use `in_process(...)` or `http(...)` to get one."""

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
        return InProcessMemoryStoreClient(
            backend, encoder=encoder, larimar=larimar, on_request=on_request
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
        return HttpMemoryStoreClient(
            base_url, timeout_s=timeout_s, retry=retry, on_request=on_request, transport=transport
        )

    async def _observe(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            return await call()
        except BaseException as e:
            error = e
            raise
        finally:
            if self.on_request is not None:
                self.on_request(
                    op, self.backend_name, status_label(error), time.perf_counter() - start
                )

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


# ---------------------------------------------------------------------------------------------
# In process.
# ---------------------------------------------------------------------------------------------


class InProcessMemoryStoreClient(MemoryStoreClient):
    def __init__(
        self,
        backend: Backend,
        *,
        encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
        larimar: LarimarConfig | None = None,
        on_request: RequestHook | None = None,
    ) -> None:
        super().__init__(on_request)
        if encoder is None:
            from memory_store.embedder import default_embedder

            encoder = default_embedder
        self.backend = backend
        self.backend_name = backend.name
        self.encodings = EncodingStore(backend)
        self.records = RecordStore(backend)
        self.larimar = LarimarStore(backend, encoder, larimar)

    async def ping(self) -> None:
        await self._observe("ping", self.backend.ping)

    async def put_chunk(
        self,
        fingerprint: str,
        chain_hash: str,
        chunk: ChunkEncoding,
        quantization: Quantization = "fp16",
    ) -> bool:
        return await self._observe(
            "put_chunk",
            lambda: self.encodings.put_chunk(fingerprint, chain_hash, chunk, quantization),
        )

    async def has_chunk(self, fingerprint: str, chain_hash: str) -> bool:
        return await self._observe(
            "has_chunk", lambda: self.encodings.has_chunk(fingerprint, chain_hash)
        )

    async def get_chunk(self, fingerprint: str, chain_hash: str) -> ChunkEncoding:
        return await self._observe(
            "get_chunk", lambda: self.encodings.get_chunk(fingerprint, chain_hash)
        )

    async def put_manifest(self, session_id: str, doc_id: str, manifest: DocumentManifest) -> None:
        await self._observe(
            "put_manifest", lambda: self.encodings.put_manifest(session_id, doc_id, manifest)
        )

    async def get_manifest(self, session_id: str, doc_id: str) -> DocumentManifest:
        return await self._observe(
            "get_manifest", lambda: self.encodings.get_manifest(session_id, doc_id)
        )

    async def list_documents(self, session_id: str) -> list[DocumentManifest]:
        return await self._observe(
            "list_documents", lambda: self.encodings.list_documents(session_id)
        )

    async def delete_session(self, session_id: str) -> int:
        self.larimar.evict(session_id)
        return await self._observe(
            "delete_session", lambda: self.encodings.delete_session(session_id)
        )

    async def add_to_collection(
        self, name: str, fingerprint: str, chain_hashes: Sequence[str], embeddings: np.ndarray
    ) -> int:
        return await self._observe(
            "add_to_collection",
            lambda: self.encodings.add_to_collection(name, fingerprint, chain_hashes, embeddings),
        )

    async def select_chunks(
        self, name: str, query_embedding: np.ndarray, top_k: int
    ) -> list[ChunkRef]:
        return await self._observe(
            "select_chunks", lambda: self.encodings.select_chunks(name, query_embedding, top_k)
        )

    async def collection_chunks(self, name: str) -> list[ChunkRef]:
        return await self._observe(
            "collection_chunks", lambda: self.encodings.collection_chunks(name)
        )

    async def delete_collection(self, name: str) -> int:
        return await self._observe(
            "delete_collection", lambda: self.encodings.delete_collection(name)
        )

    async def put_record(self, namespace: str, key: str, record: Mapping[str, Any]) -> None:
        await self._observe("put_record", lambda: self.records.put_record(namespace, key, record))

    async def get_record(self, namespace: str, key: str) -> dict[str, Any]:
        return await self._observe("get_record", lambda: self.records.get_record(namespace, key))

    async def list_records(self, namespace: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        return await self._observe(
            "list_records", lambda: self.records.list_records(namespace, prefix)
        )

    async def delete_record(self, namespace: str, key: str) -> bool:
        return await self._observe(
            "delete_record", lambda: self.records.delete_record(namespace, key)
        )

    async def put_blob(self, namespace: str, key: str, data: bytes) -> None:
        await self._observe("put_blob", lambda: self.records.put_blob(namespace, key, data))

    async def get_blob(self, namespace: str, key: str) -> bytes:
        return await self._observe("get_blob", lambda: self.records.get_blob(namespace, key))

    async def larimar_write(
        self,
        session_id: str,
        *,
        text: str | None = None,
        segments: Sequence[str] | None = None,
        save: bool = False,
    ) -> int:
        async def write() -> int:
            n = await self.larimar.write(session_id, text=text, segments=segments)
            if save:
                await self.larimar.save(session_id)
            return n

        return await self._observe("larimar_write", write)

    async def larimar_read(
        self, session_id: str, query: str, top_k: int = 3, use_prefix: bool = True
    ) -> list[LarimarHit]:
        return await self._observe(
            "larimar_read", lambda: self.larimar.read(session_id, query, top_k, use_prefix)
        )

    async def larimar_save(self, session_id: str) -> None:
        await self._observe("larimar_save", lambda: self.larimar.save(session_id))

    async def larimar_load(self, session_id: str) -> dict[str, int]:
        async def load() -> dict[str, int]:
            await self.larimar.load(session_id)
            return await self.larimar.info(session_id)

        return await self._observe("larimar_load", load)

    async def close(self) -> None:
        await self.backend.close()


# ---------------------------------------------------------------------------------------------
# Over HTTP.
# ---------------------------------------------------------------------------------------------


class _RetryableStatus(Exception):
    """A 503 from the service: worth another try."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class HttpMemoryStoreClient(MemoryStoreClient):
    """httpx.AsyncClient to `longserve memory-store`.

    Record and blob namespaces and keys are validated here before they become URL segments
    (a "/" in one would name another route).

    Idempotent calls are retried on connection errors, timeouts and 503s; calls that append
    (Larimar writes) only when the connection was never made. After the last try the error is
    raised as StoreUnavailableError from its cause. httpx reconnects by itself, so a service that
    comes back is used again on the next call.
    """

    backend_name = "http"
    _NOT_IDEMPOTENT = frozenset({"larimar_write"})

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        on_request: RequestHook | None = None,
        transport: Any = None,
    ) -> None:
        import httpx

        super().__init__(on_request)
        self._httpx = httpx
        self.retry = retry or RetryPolicy()
        kwargs: dict[str, Any] = {"base_url": base_url.rstrip("/"), "timeout": timeout_s}
        if transport is not None:
            kwargs["transport"] = transport
        self._client = httpx.AsyncClient(**kwargs)

    async def _request(
        self, op: str, method: str, url: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any
    ) -> Any:
        httpx = self._httpx
        if op in self._NOT_IDEMPOTENT:
            transient: tuple[type[BaseException], ...] = (httpx.ConnectError, httpx.ConnectTimeout)
        else:
            transient = (httpx.TransportError, _RetryableStatus)

        async def once() -> Any:
            response = await self._client.request(method, url, **kwargs)
            if response.status_code == 503 and op not in self._NOT_IDEMPOTENT:
                raise _RetryableStatus(_message(response))
            return response

        async def call() -> Any:
            try:
                response = await retrying(once, self.retry, transient, f"memory store {op}")
            except StoreUnavailableError:
                raise
            except httpx.HTTPError as e:
                raise StoreUnavailableError(f"memory store {op}: {e}") from e
            if response.status_code in ok:
                return response
            raise _error_for(response)

        return await self._observe(op, call)

    async def ping(self) -> None:
        await self._request("ping", "GET", "/ready")

    async def put_chunk(
        self,
        fingerprint: str,
        chain_hash: str,
        chunk: ChunkEncoding,
        quantization: Quantization = "fp16",
    ) -> bool:
        body = encode_chunk(chunk, quantization)
        response = await self._request(
            "put_chunk",
            "PUT",
            f"/v1/chunks/{fingerprint}/{chain_hash}",
            ok=(200, 201),
            content=body,
            headers={"content-type": "application/octet-stream"},
        )
        return bool(response.json()["created"])

    async def has_chunk(self, fingerprint: str, chain_hash: str) -> bool:
        response = await self._request(
            "has_chunk", "HEAD", f"/v1/chunks/{fingerprint}/{chain_hash}", ok=(200, 404)
        )
        return bool(response.status_code == 200)

    async def get_chunk(self, fingerprint: str, chain_hash: str) -> ChunkEncoding:
        response = await self._request("get_chunk", "GET", f"/v1/chunks/{fingerprint}/{chain_hash}")
        return decode_chunk(response.content)

    async def put_manifest(self, session_id: str, doc_id: str, manifest: DocumentManifest) -> None:
        await self._request(
            "put_manifest",
            "PUT",
            f"/v1/sessions/{session_id}/documents/{doc_id}",
            json=manifest.to_record(),
        )

    async def get_manifest(self, session_id: str, doc_id: str) -> DocumentManifest:
        response = await self._request(
            "get_manifest", "GET", f"/v1/sessions/{session_id}/documents/{doc_id}"
        )
        return DocumentManifest.from_record(response.json())

    async def list_documents(self, session_id: str) -> list[DocumentManifest]:
        response = await self._request(
            "list_documents", "GET", f"/v1/sessions/{session_id}/documents"
        )
        return [DocumentManifest.from_record(d) for d in response.json()["data"]]

    async def delete_session(self, session_id: str) -> int:
        response = await self._request("delete_session", "DELETE", f"/v1/sessions/{session_id}")
        return int(response.json()["deleted"])

    async def add_to_collection(
        self, name: str, fingerprint: str, chain_hashes: Sequence[str], embeddings: np.ndarray
    ) -> int:
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.ndim != 2:
            raise InvalidStoreRequest("embeddings must be (n, d)")
        body = {
            "fingerprint": fingerprint,
            "chain_hashes": list(chain_hashes),
            "dim": int(emb.shape[1]),
            "embeddings_b64": base64.b64encode(embeddings_to_bytes(emb)).decode("ascii"),
        }
        response = await self._request(
            "add_to_collection", "POST", f"/v1/collections/{name}/chunks", json=body
        )
        return int(response.json()["added"])

    async def select_chunks(
        self, name: str, query_embedding: np.ndarray, top_k: int
    ) -> list[ChunkRef]:
        body = {
            "query_embedding": np.asarray(query_embedding, dtype=np.float32).reshape(-1).tolist(),
            "top_k": top_k,
        }
        response = await self._request(
            "select_chunks", "POST", f"/v1/collections/{name}/select", json=body
        )
        return [
            ChunkRef(d["fingerprint"], d["chain_hash"], float(d["score"]))
            for d in response.json()["data"]
        ]

    async def collection_chunks(self, name: str) -> list[ChunkRef]:
        response = await self._request("collection_chunks", "GET", f"/v1/collections/{name}/chunks")
        return [ChunkRef(d["fingerprint"], d["chain_hash"], 0.0) for d in response.json()["data"]]

    async def delete_collection(self, name: str) -> int:
        response = await self._request("delete_collection", "DELETE", f"/v1/collections/{name}")
        return int(response.json()["deleted"])

    async def put_record(self, namespace: str, key: str, record: Mapping[str, Any]) -> None:
        KeySpace.record(namespace, key)
        await self._request(
            "put_record", "PUT", f"/v1/records/{namespace}/{key}", json=dict(record)
        )

    async def get_record(self, namespace: str, key: str) -> dict[str, Any]:
        KeySpace.record(namespace, key)
        response = await self._request("get_record", "GET", f"/v1/records/{namespace}/{key}")
        record = response.json()
        if not isinstance(record, dict):
            raise StoreError("the memory store answered a record that is not an object")
        return record

    async def list_records(self, namespace: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        KeySpace.namespace_tag(namespace)
        response = await self._request(
            "list_records", "GET", f"/v1/records/{namespace}", params={"prefix": prefix}
        )
        return {str(d["key"]): dict(d["record"]) for d in response.json()["data"]}

    async def delete_record(self, namespace: str, key: str) -> bool:
        KeySpace.record(namespace, key)
        response = await self._request("delete_record", "DELETE", f"/v1/records/{namespace}/{key}")
        return bool(response.json()["deleted"])

    async def put_blob(self, namespace: str, key: str, data: bytes) -> None:
        KeySpace.blob(namespace, key)
        await self._request(
            "put_blob",
            "PUT",
            f"/v1/blobs/{namespace}/{key}",
            content=bytes(data),
            headers={"content-type": "application/octet-stream"},
        )

    async def get_blob(self, namespace: str, key: str) -> bytes:
        KeySpace.blob(namespace, key)
        response = await self._request("get_blob", "GET", f"/v1/blobs/{namespace}/{key}")
        return bytes(response.content)

    async def larimar_write(
        self,
        session_id: str,
        *,
        text: str | None = None,
        segments: Sequence[str] | None = None,
        save: bool = False,
    ) -> int:
        body = {
            "text": text,
            "segments": list(segments) if segments is not None else None,
            "save": save,
        }
        response = await self._request(
            "larimar_write", "POST", f"/v1/sessions/{session_id}/larimar/write", json=body
        )
        return int(response.json()["written"])

    async def larimar_read(
        self, session_id: str, query: str, top_k: int = 3, use_prefix: bool = True
    ) -> list[LarimarHit]:
        body = {"query": query, "top_k": top_k, "use_prefix": use_prefix}
        response = await self._request(
            "larimar_read", "POST", f"/v1/sessions/{session_id}/larimar/read", json=body
        )
        return [
            LarimarHit(
                int(d["slot"]), tuple(d["segment_indices"]), tuple(d["texts"]), float(d["distance"])
            )
            for d in response.json()["data"]
        ]

    async def larimar_save(self, session_id: str) -> None:
        await self._request("larimar_save", "POST", f"/v1/sessions/{session_id}/larimar/save")

    async def larimar_load(self, session_id: str) -> dict[str, int]:
        response = await self._request(
            "larimar_load", "POST", f"/v1/sessions/{session_id}/larimar/load"
        )
        return {k: int(v) for k, v in response.json().items()}

    async def close(self) -> None:
        await self._client.aclose()


def _message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


def _error_for(response: Any) -> StoreError:
    message = _message(response)
    status = response.status_code
    if status == 404:
        return NotFound(message)
    if status == 409:
        return Conflict(message)
    if status in (400, 413, 422):
        return InvalidStoreRequest(message)
    if status == 503:
        return StoreUnavailableError(message)
    return StoreError(f"memory store answered {status}: {message}")


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
