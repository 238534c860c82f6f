"""`MemoryStoreClient` in this process: the encoding, record and Larimar stores over a backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from memory_store.backends.base import Backend
from memory_store.client_api import MemoryStoreClient
from memory_store.embedder import TextEncoder
from memory_store.encoding_store import EncodingStore
from memory_store.encodings import ChunkEncoding, ChunkRef, DocumentManifest, Quantization
from memory_store.larimar import LarimarConfig, LarimarHit, LarimarStore
from memory_store.observed import RequestHook
from memory_store.reclaim import Reclaimer
from memory_store.records import RecordStore
from memory_store.usage import UsageClaim, UsageLedger, release_session

DEFAULT_CHUNK_GRACE_S = 3600.0  # MemoryStoreSettings.chunk_grace_s's default


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
        self.ledger = UsageLedger(backend)
        self.reclaimer = Reclaimer(backend, on_session_expired=release_session(backend))

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

        async def delete() -> int:
            return (await self.reclaimer.delete_session(session_id)).keys_deleted

        return await self._observe("delete_session", delete)

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

    async def claim_usage(
        self,
        tenant: str,
        item: str,
        amounts: Mapping[str, int],
        limits: Mapping[str, int] | None = None,
    ) -> UsageClaim:
        return await self._observe(
            "claim_usage", lambda: self.ledger.claim(tenant, item, amounts, limits)
        )

    async def release_usage(self, tenant: str, item: str) -> dict[str, int]:
        return await self._observe("release_usage", lambda: self.ledger.release(tenant, item))

    async def usage(self, tenant: str) -> dict[str, int]:
        return await self._observe("usage", lambda: self.ledger.totals(tenant))

    async def close(self) -> None:
        await self.backend.close()

    # Reclamation ------------------------------------------------------------------------------

    async def delete_blob(self, namespace: str, key: str) -> bool:
        return await self._observe("delete_blob", lambda: self.records.delete_blob(namespace, key))

    async def drop_unnamed_chunks(
        self, session_id: str, fingerprint: str, hashes: Sequence[str]
    ) -> int:
        async def drop() -> int:
            chunks = [(fingerprint, h) for h in hashes]
            return (await self.reclaimer.drop_unnamed_chunks(session_id, chunks)).chunks_deleted

        return await self._observe("drop_unnamed_chunks", drop)

    async def reclaim(self, chunk_grace_s: float | None = None) -> dict[str, int]:
        grace = DEFAULT_CHUNK_GRACE_S if chunk_grace_s is None else chunk_grace_s

        async def sweep() -> dict[str, int]:
            return (await self.reclaimer.sweep(grace)).to_record()

        return await self._observe("reclaim", sweep)
