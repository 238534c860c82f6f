"""`MemoryStoreClient` over HTTP: httpx to a remote `longserve memory-store`."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from memory_store.client_api import MemoryStoreClient
from memory_store.encodings import (
    ChunkEncoding,
    ChunkRef,
    DocumentManifest,
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
    StoreFull,
    StoreUnavailableError,
)
from memory_store.keys import KeySpace
from memory_store.larimar import LarimarHit
from memory_store.observed import RequestHook
from memory_store.retry import RetryPolicy, retrying
from memory_store.usage import UsageClaim


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
        token: str | None = None,
    ) -> None:
        import httpx

        super().__init__(on_request)
        self._httpx = httpx
        self.retry = retry or RetryPolicy()
        kwargs: dict[str, Any] = {"base_url": base_url.rstrip("/"), "timeout": timeout_s}
        if token:
            kwargs["headers"] = {"authorization": f"Bearer {token}"}
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
            full = response.status_code == 503 and _code(response) == "memory_store_full"
            if response.status_code == 503 and op not in self._NOT_IDEMPOTENT and not full:
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

    async def claim_usage(
        self,
        tenant: str,
        item: str,
        amounts: Mapping[str, int],
        limits: Mapping[str, int] | None = None,
    ) -> UsageClaim:
        KeySpace.usage_tag(tenant)
        body = {"item": item, "amounts": dict(amounts), "limits": dict(limits or {})}
        response = await self._request(
            "claim_usage", "POST", f"/v1/usage/{tenant}/claim", json=body
        )
        return UsageClaim.from_json(response.json())

    async def release_usage(self, tenant: str, item: str) -> dict[str, int]:
        KeySpace.usage_tag(tenant)
        response = await self._request(
            "release_usage", "POST", f"/v1/usage/{tenant}/release", json={"item": item}
        )
        return UsageClaim.from_json(response.json()).totals

    async def usage(self, tenant: str) -> dict[str, int]:
        KeySpace.usage_tag(tenant)
        response = await self._request("usage", "GET", f"/v1/usage/{tenant}")
        return UsageClaim.from_json(response.json()).totals

    async def close(self) -> None:
        await self._client.aclose()

    # Reclamation ------------------------------------------------------------------------------

    async def delete_blob(self, namespace: str, key: str) -> bool:
        KeySpace.blob(namespace, key)
        response = await self._request("delete_blob", "DELETE", f"/v1/blobs/{namespace}/{key}")
        return bool(response.json()["deleted"])

    async def drop_unnamed_chunks(
        self, session_id: str, fingerprint: str, hashes: Sequence[str]
    ) -> int:
        for h in hashes:
            KeySpace.chunk(fingerprint, h)  # ids checked before they travel
        body = {"fingerprint": fingerprint, "hashes": list(hashes)}
        response = await self._request(
            "drop_unnamed_chunks", "POST", f"/v1/sessions/{session_id}/unnamed-chunks", json=body
        )
        return int(response.json()["chunks_deleted"])

    async def reclaim(self, chunk_grace_s: float | None = None) -> dict[str, int]:
        body = {"chunk_grace_s": chunk_grace_s}
        response = await self._request("reclaim", "POST", "/v1/reclaim", json=body)
        return {str(k): int(v) for k, v in response.json().items()}


def _message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


def _code(response: Any) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


def _error_for(response: Any) -> StoreError:
    message = _message(response)
    status = response.status_code
    if status == 401:  # a misconfigured server: no retry helps
        return StoreUnavailableError(
            "the memory store refused this server's token (LONGSERVE_MEMORY_STORE_TOKEN)"
        )
    if status == 404:
        return NotFound(message)
    if status == 409:
        return Conflict(message)
    if status in (400, 413, 422):
        return InvalidStoreRequest(message)
    if status == 503 and _code(response) == "memory_store_full":
        return StoreFull(message)
    if status == 503:
        return StoreUnavailableError(message)
    return StoreError(f"memory store answered {status}: {message}")
