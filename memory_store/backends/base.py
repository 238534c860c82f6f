"""The storage interface of the memory service: blobs and small records under `Key`s.

Records go through an injectable `Serializer` (compact JSON by default); blobs are raw bytes.
Every failure surfaces as one exception tree (`StoreError`), raised `from` the cause.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Protocol

from memory_store.errors import StoreError
from memory_store.keys import Key


class Serializer(Protocol):
    def dumps(self, obj: Mapping[str, Any]) -> bytes: ...

    def loads(self, data: bytes) -> dict[str, Any]: ...


class JsonSerializer:
    """Compact UTF-8 JSON. Records are small (manifests, headers); blobs never go through it."""

    def dumps(self, obj: Mapping[str, Any]) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def loads(self, data: bytes) -> dict[str, Any]:
        value = json.loads(data.decode("utf-8"))
        if not isinstance(value, dict):
            raise StoreError("stored record is not a JSON object")
        return value


class Backend(ABC):
    """Blobs (bytes of any size) and records (small JSON objects) under `Key`s. All async.

    A write returns only once the backend has accepted it durably as far as the backend goes
    (file fsynced and renamed; Redis command answered, AOF fsync policy being Redis's own).
    Blobs and records live in separate namespaces: the same key may hold one of each.
    """

    name: str = "backend"

    @abstractmethod
    async def put_blob(self, key: Key, data: bytes) -> None: ...

    @abstractmethod
    async def get_blob(self, key: Key) -> bytes:
        """Raises NotFound."""

    @abstractmethod
    async def has_blob(self, key: Key) -> bool: ...

    @abstractmethod
    async def put_record(
        self, key: Key, record: Mapping[str, Any], *, if_absent: bool = False
    ) -> None:
        """Raises Conflict when `if_absent` and a record is already there."""

    @abstractmethod
    async def get_record(self, key: Key) -> dict[str, Any]:
        """Raises NotFound."""

    @abstractmethod
    async def delete(self, key: Key) -> bool:
        """Delete the blob and the record under `key`; True if anything was there."""

    @abstractmethod
    async def list_paths(self, tag: str, prefix: str = "") -> list[str]:
        """Sorted paths under `tag` (blob or record) that start with `prefix`."""

    @abstractmethod
    async def delete_tag(self, tag: str) -> int:
        """Delete everything under `tag`; returns how many keys went."""

    @abstractmethod
    async def ping(self) -> None:
        """Raises StoreUnavailableError when the backend cannot be reached."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # Reclamation (memory_store/reclaim.py) ----------------------------------------------------

    @abstractmethod
    async def list_tags(self, prefix: str) -> list[str]:
        """Every tag that holds something and starts with `prefix`, sorted (a full scan)."""

    @abstractmethod
    async def tag_bytes(self, tag: str) -> int:
        """The bytes the values under `tag` hold (blobs' sizes plus records' serialized ones)."""

    @abstractmethod
    async def idle_seconds(self, key: Key) -> float | None:
        """Seconds since the blob under `key` was last written (embedded) or touched (Redis);
        None when there is none."""
