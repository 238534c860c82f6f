"""Routes of the encoder-output store: chunks, session manifests, collections."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from memory_store.encodings import DocumentManifest, embeddings_from_bytes
from memory_store.errors import InvalidStoreRequest
from memory_store.keys import KeySpace
from memory_store.service import OCTET, MemoryStoreService


class ManifestBody(BaseModel):
    doc_id: str
    fingerprint: str
    chunk_hashes: list[str]
    name: str = ""
    num_tokens: int = 0
    created_at: float = 0.0
    meta: dict[str, Any] = Field(default_factory=dict)


class CollectionAddBody(BaseModel):
    fingerprint: str
    chain_hashes: list[str]
    dim: int = Field(gt=0)
    embeddings_b64: str  # little-endian float32, row-major (n, dim)


class UnnamedChunksBody(BaseModel):
    fingerprint: str
    hashes: list[str] = Field(max_length=100_000)


class CollectionSelectBody(BaseModel):
    query_embedding: list[float]
    top_k: int = Field(8, ge=1, le=10_000)


def build_router(svc: MemoryStoreService) -> APIRouter:
    """The chunk, manifest and collection routes over `svc`."""
    router = APIRouter()

    # Chunks -----------------------------------------------------------------------------------

    @router.put("/v1/chunks/{fingerprint}/{chain_hash}")
    async def put_chunk(fingerprint: str, chain_hash: str, request: Request) -> JSONResponse:
        async with svc.track("put_chunk"):
            data = await svc.read_body(request)
            created = await svc.encodings.put_chunk_bytes(fingerprint, chain_hash, data)
        return JSONResponse({"created": created}, status_code=201 if created else 200)

    @router.head("/v1/chunks/{fingerprint}/{chain_hash}")
    async def has_chunk(fingerprint: str, chain_hash: str) -> Response:
        async with svc.track("has_chunk"):
            found = await svc.encodings.has_chunk(fingerprint, chain_hash)
        return Response(status_code=200 if found else 404)

    @router.get("/v1/chunks/{fingerprint}/{chain_hash}")
    async def get_chunk(fingerprint: str, chain_hash: str) -> Response:
        async with svc.track("get_chunk"):
            data = await svc.encodings.get_chunk_bytes(fingerprint, chain_hash)
        return Response(data, media_type=OCTET)

    # Manifests --------------------------------------------------------------------------------

    @router.put("/v1/sessions/{session_id}/documents/{doc_id}")
    async def put_manifest(session_id: str, doc_id: str, body: ManifestBody) -> dict[str, Any]:
        async with svc.track("put_manifest"):
            manifest = DocumentManifest.from_record(body.model_dump())
            await svc.encodings.put_manifest(session_id, doc_id, manifest)
            stored = await svc.encodings.get_manifest(session_id, doc_id)
        return stored.to_record()

    @router.get("/v1/sessions/{session_id}/documents/{doc_id}")
    async def get_manifest(session_id: str, doc_id: str) -> dict[str, Any]:
        async with svc.track("get_manifest"):
            manifest = await svc.encodings.get_manifest(session_id, doc_id)
        return manifest.to_record()

    @router.get("/v1/sessions/{session_id}/documents")
    async def list_documents(session_id: str) -> dict[str, Any]:
        async with svc.track("list_documents"):
            docs = await svc.encodings.list_documents(session_id)
        return {"object": "list", "data": [d.to_record() for d in docs]}

    @router.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        async with svc.track("delete_session"):
            svc.larimar.evict(session_id)
            report = await svc.reclaimer.delete_session(session_id)
        svc.metrics.count_reclaimed(report.to_record())
        return {"id": session_id, "deleted": report.keys_deleted, **report.to_record()}

    @router.post("/v1/sessions/{session_id}/unnamed-chunks")
    async def drop_unnamed_chunks(session_id: str, body: UnnamedChunksBody) -> dict[str, Any]:
        async with svc.track("drop_unnamed_chunks"):
            chunks = [(body.fingerprint, h) for h in body.hashes]
            for fingerprint, h in chunks:
                KeySpace.chunk(fingerprint, h)  # InvalidStoreRequest -> 400
            report = await svc.reclaimer.drop_unnamed_chunks(session_id, chunks)
        svc.metrics.count_reclaimed(report.to_record())
        return report.to_record()

    # Collections ------------------------------------------------------------------------------

    @router.post("/v1/collections/{name}/chunks")
    async def add_to_collection(name: str, body: CollectionAddBody) -> dict[str, Any]:
        async with svc.track("add_to_collection"):
            try:
                raw = base64.b64decode(body.embeddings_b64, validate=True)
            except ValueError as e:
                raise InvalidStoreRequest(f"embeddings_b64 is not base64: {e}") from e
            emb = embeddings_from_bytes(raw, body.dim)
            added = await svc.encodings.add_to_collection(
                name, body.fingerprint, body.chain_hashes, emb
            )
        return {"added": added}

    @router.post("/v1/collections/{name}/select")
    async def select_chunks(name: str, body: CollectionSelectBody) -> dict[str, Any]:
        async with svc.track("select_chunks"):
            refs = await svc.encodings.select_chunks(
                name, np.asarray(body.query_embedding, dtype=np.float32), body.top_k
            )
        return {
            "object": "list",
            "data": [
                {"fingerprint": r.fingerprint, "chain_hash": r.chain_hash, "score": r.score}
                for r in refs
            ],
        }

    @router.get("/v1/collections/{name}/chunks")
    async def collection_chunks(name: str) -> dict[str, Any]:
        async with svc.track("collection_chunks"):
            refs = await svc.encodings.collection_chunks(name)
        return {
            "object": "list",
            "data": [{"fingerprint": r.fingerprint, "chain_hash": r.chain_hash} for r in refs],
        }

    @router.delete("/v1/collections/{name}")
    async def delete_collection(name: str) -> dict[str, Any]:
        async with svc.track("delete_collection"):
            deleted = await svc.encodings.delete_collection(name)
        return {"name": name, "deleted": deleted}

    return router
