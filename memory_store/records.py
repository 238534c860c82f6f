"""Generic records and blobs: what the server keeps about sessions that is not an encoding.

A record is a small JSON object, a blob any bytes (a document's extracted text), each under a
key inside a namespace. Namespaces are `KeySpace.NAMESPACE_KINDS` prefixed ids, and each is one
hash tag (`{sess:ID}`, `{tenant:ID}`): a session's records live beside the manifests the engine
writes for it, so one `delete_session` removes everything the session owns, and Redis Cluster
keeps them in one slot.

Records and blobs sit under separate path prefixes, so listing a namespace's records never
reads a blob (listing a session's documents does not load their texts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memory_store.backends.base import Backend
from memory_store.errors import InvalidStoreRequest, NotFound
from memory_store.keys import KeySpace


class RecordStore:
    """Records and blobs over a `Backend`; every `put_*` returns once the write is durable."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def put_record(self, namespace: str, key: str, record: Mapping[str, Any]) -> None:
        if not isinstance(record, Mapping):
            raise InvalidStoreRequest("a record must be a JSON object")
        await self.backend.put_record(KeySpace.record(namespace, key), dict(record))

    async def get_record(self, namespace: str, key: str) -> dict[str, Any]:
        try:
            return await self.backend.get_record(KeySpace.record(namespace, key))
        except NotFound as e:
            raise NotFound(f"no record {key!r} in {namespace}") from e

    async def list_records(self, namespace: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Every record of the namespace whose key starts with `prefix`, by key (sorted)."""
        tag = KeySpace.namespace_tag(namespace)
        out: dict[str, dict[str, Any]] = {}
        for path in await self.backend.list_paths(tag, KeySpace.RECORD_PREFIX + prefix):
            key = path[len(KeySpace.RECORD_PREFIX) :]
            try:
                out[key] = await self.backend.get_record(KeySpace.record(namespace, key))
            except NotFound:
                continue  # deleted meanwhile
        return out

    async def delete_record(self, namespace: str, key: str) -> bool:
        return await self.backend.delete(KeySpace.record(namespace, key))

    async def put_blob(self, namespace: str, key: str, data: bytes) -> None:
        await self.backend.put_blob(KeySpace.blob(namespace, key), bytes(data))

    async def get_blob(self, namespace: str, key: str) -> bytes:
        try:
            return await self.backend.get_blob(KeySpace.blob(namespace, key))
        except NotFound as e:
            raise NotFound(f"no blob {key!r} in {namespace}") from e

    async def delete_blob(self, namespace: str, key: str) -> bool:
        return await self.backend.delete(KeySpace.blob(namespace, key))
