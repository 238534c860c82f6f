"""The encoder-output store over a backend: chunks, session manifests and collections.

Chunks are content-addressed (model fingerprint, prefix-chain hash), so identical documents are
stored once however many sessions read them. Collections hold pre-encoded chunks with their
`EmbD(c)`; `select_chunks` ranks them by `EmbQ(x) . EmbD(c)` to decide which chunks to load for a
query. The codec and the types are in `memory_store.encodings`.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
import uuid
from collections.abc import Sequence

import numpy as np

from memory_store.backends.base import Backend
from memory_store.encodings import (
    ChunkEncoding,
    ChunkRef,
    DocumentManifest,
    Quantization,
    decode_chunk,
    embeddings_from_bytes,
    embeddings_to_bytes,
    encode_chunk,
)
from memory_store.errors import InvalidStoreRequest, NotFound, StoreError
from memory_store.keys import KeySpace, validate_id


class EncodingStore:
    """The encoder-output store over a `Backend`. Every `put_*` returns once the write is durable."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # name -> (batch paths, fingerprints, hashes, embeddings (n, d)); refreshed when batches change
        self._collections: dict[str, tuple[tuple[str, ...], list[str], list[str], np.ndarray]] = {}

    # Chunks -----------------------------------------------------------------------------------

    async def put_chunk(
        self,
        fingerprint: str,
        chain_hash: str,
        chunk: ChunkEncoding,
        quantization: Quantization = "fp16",
    ) -> bool:
        """Store a chunk; False when it was already stored (content addressing: nothing written)."""
        return await self.put_chunk_bytes(
            fingerprint, chain_hash, encode_chunk(chunk, quantization)
        )

    async def put_chunk_bytes(self, fingerprint: str, chain_hash: str, data: bytes) -> bool:
        """Store an already-encoded chunk (the HTTP path); validates it first."""
        key = KeySpace.chunk(fingerprint, chain_hash)
        decode_chunk(data)
        if await self.backend.has_blob(key):
            return False
        await self.backend.put_blob(key, data)
        return True

    async def has_chunk(self, fingerprint: str, chain_hash: str) -> bool:
        return await self.backend.has_blob(KeySpace.chunk(fingerprint, chain_hash))

    async def get_chunk_bytes(self, fingerprint: str, chain_hash: str) -> bytes:
        try:
            return await self.backend.get_blob(KeySpace.chunk(fingerprint, chain_hash))
        except NotFound as e:
            raise NotFound(f"no chunk {chain_hash} for model {fingerprint}") from e

    async def get_chunk(self, fingerprint: str, chain_hash: str) -> ChunkEncoding:
        return decode_chunk(await self.get_chunk_bytes(fingerprint, chain_hash))

    # Manifests --------------------------------------------------------------------------------

    async def put_manifest(self, session_id: str, doc_id: str, manifest: DocumentManifest) -> None:
        """Store (or replace) the session's manifest of `doc_id` (must equal `manifest.doc_id`)."""
        if manifest.doc_id != doc_id:
            raise InvalidStoreRequest(
                f"manifest is for document {manifest.doc_id!r}, not {doc_id!r}"
            )
        if not manifest.created_at:
            manifest = dataclasses.replace(manifest, created_at=time.time())
        rec = DocumentManifest.from_record(manifest.to_record()).to_record()  # validates ids
        await self.backend.put_record(KeySpace.manifest(session_id, doc_id), rec)

    async def get_manifest(self, session_id: str, doc_id: str) -> DocumentManifest:
        try:
            rec = await self.backend.get_record(KeySpace.manifest(session_id, doc_id))
        except NotFound as e:
            raise NotFound(f"session {session_id} has no document {doc_id}") from e
        return DocumentManifest.from_record(rec)

    async def list_documents(self, session_id: str) -> list[DocumentManifest]:
        """The session's manifests, oldest first."""
        tag = KeySpace.session_tag(session_id)
        out = []
        for path in await self.backend.list_paths(tag, KeySpace.MANIFEST_PREFIX):
            doc_id = path[len(KeySpace.MANIFEST_PREFIX) :]
            try:
                out.append(await self.get_manifest(session_id, doc_id))
            except NotFound:
                continue  # deleted meanwhile
        return sorted(out, key=lambda m: (m.created_at, m.doc_id))

    async def delete_session(self, session_id: str) -> int:
        """Drop everything under the session's tag; returns how many keys went. Its chunks
        stay: `memory_store.reclaim.Reclaimer.delete_session` also drops those only it named.
        """
        return await self.backend.delete_tag(KeySpace.session_tag(session_id))

    # Collections ------------------------------------------------------------------------------

    async def add_to_collection(
        self,
        name: str,
        fingerprint: str,
        chain_hashes: Sequence[str],
        embeddings: np.ndarray,
    ) -> int:
        """Attach chunks (already stored with `put_chunk`) with their EmbD(c) `(n, d)`.

        Each call writes one immutable batch, so concurrent writers never overwrite each other.
        """
        validate_id(fingerprint, "model fingerprint")
        hashes = [validate_id(h, "chain hash") for h in chain_hashes]
        emb = np.asarray(embeddings, dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != len(hashes) or not hashes:
            raise InvalidStoreRequest(
                "embeddings must be (n, d) with one row per chain hash, n >= 1"
            )
        batch_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
        header = json.dumps(
            {"fingerprint": fingerprint, "chain_hashes": hashes, "dim": int(emb.shape[1])}
        ).encode()
        blob = struct.pack("<I", len(header)) + header + embeddings_to_bytes(emb)
        await self.backend.put_blob(KeySpace.collection_batch(name, batch_id), blob)
        return len(hashes)

    async def _load_collection(self, name: str) -> tuple[list[str], list[str], np.ndarray]:
        tag = KeySpace.collection_tag(name)
        paths = tuple(await self.backend.list_paths(tag, KeySpace.COLLECTION_BATCH_PREFIX))
        if not paths:
            raise NotFound(f"no collection {name}")
        cached = self._collections.get(name)
        if cached is not None and cached[0] == paths:
            return cached[1], cached[2], cached[3]
        fps: list[str] = []
        hashes: list[str] = []
        mats: list[np.ndarray] = []
        for path in paths:
            blob = await self.backend.get_blob(
                KeySpace.collection_batch(name, path.split("/", 1)[1])
            )
            (head_len,) = struct.unpack("<I", blob[:4])
            head = json.loads(blob[4 : 4 + head_len])
            mat = embeddings_from_bytes(blob[4 + head_len :], int(head["dim"]))
            if mats and mat.shape[1] != mats[0].shape[1]:
                raise StoreError(f"collection {name} mixes embedding dimensions")
            fps.extend([head["fingerprint"]] * mat.shape[0])
            hashes.extend(head["chain_hashes"])
            mats.append(mat)
        matrix = np.concatenate(mats, axis=0)
        self._collections[name] = (paths, fps, hashes, matrix)
        return fps, hashes, matrix

    async def select_chunks(
        self, name: str, query_embedding: np.ndarray, top_k: int
    ) -> list[ChunkRef]:
        """Top-k chunks of the collection by EmbQ(x) . EmbD(c), best first."""
        if top_k < 1:
            raise InvalidStoreRequest("top_k must be >= 1")
        fps, hashes, matrix = await self._load_collection(name)
        q = np.asarray(query_embedding, dtype=np.float32).reshape(-1)
        if q.shape[0] != matrix.shape[1]:
            raise InvalidStoreRequest(
                f"query embedding has dim {q.shape[0]}, collection {matrix.shape[1]}"
            )
        scores = matrix @ q  # (n,)
        k = min(top_k, scores.shape[0])
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [ChunkRef(fps[i], hashes[i], float(scores[i])) for i in top]

    async def collection_chunks(self, name: str) -> list[ChunkRef]:
        """Every chunk of the collection in document order: batches in the order they were
        added (`longserve ingest` adds one file per batch), chunks in each in reading order."""
        fps, hashes, _ = await self._load_collection(name)
        return [ChunkRef(fp, h, 0.0) for fp, h in zip(fps, hashes, strict=True)]

    async def delete_collection(self, name: str) -> int:
        self._collections.pop(name, None)
        return await self.backend.delete_tag(KeySpace.collection_tag(name))
