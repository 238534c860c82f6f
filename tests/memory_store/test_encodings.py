"""The encoder-output store: wire format, chain hashes, dedup across sessions, collections."""

from __future__ import annotations

import numpy as np
import pytest

from memory_store.backends import Backend
from memory_store.encoding_store import EncodingStore
from memory_store.encodings import (
    ChunkEncoding,
    DocumentManifest,
    chain_hash,
    chain_hashes,
    decode_chunk,
    encode_chunk,
)
from memory_store.errors import InvalidStoreRequest, NotFound
from memory_store.keys import KeySpace

FP = "smollm2-135m.q8.abc123"


def make_chunk(
    seed: int = 0, layers: int = 3, kv_heads: int = 2, t: int = 16, head_dim: int = 8
) -> ChunkEncoding:
    rng = np.random.default_rng(seed)
    shape = (kv_heads, t, head_dim)
    return ChunkEncoding(
        keys=tuple(rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(layers)),
        values=tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(layers)),
        token_ids=rng.integers(0, 50_000, size=t),
        text=f"chunk {seed} – ünïcode text",
        embedding=rng.standard_normal(384).astype(np.float32),
        layers=tuple(range(0, 2 * layers, 2)),
        meta={"start_token": 16 * seed},
    )


def test_fp16_round_trip_is_exact() -> None:
    chunk = make_chunk()
    back = decode_chunk(encode_chunk(chunk, "fp16"))
    for orig, got in zip(chunk.keys + chunk.values, back.keys + back.values, strict=True):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, orig.astype(np.float16))
    np.testing.assert_array_equal(back.token_ids, chunk.token_ids)
    np.testing.assert_array_equal(back.embedding, chunk.embedding)
    assert back.text == chunk.text and back.layers == chunk.layers and back.meta == chunk.meta


def test_int8_round_trip_within_per_row_tolerance() -> None:
    chunk = make_chunk(seed=1, head_dim=64, t=32)
    data = encode_chunk(chunk, "int8")
    assert len(data) < 0.6 * len(encode_chunk(chunk, "fp16"))
    back = decode_chunk(data)
    for orig, got in zip(chunk.keys + chunk.values, back.keys + back.values, strict=True):
        row_max = np.abs(orig).max(axis=-1, keepdims=True)
        # half a quantization step, plus the fp16 rounding of the result
        assert np.all(np.abs(got.astype(np.float32) - orig) <= row_max / 254 + 1e-2 * row_max)


@pytest.mark.parametrize("cut", [3, 20, -1])
def test_truncated_or_corrupt_chunks_are_rejected(cut: int) -> None:
    data = encode_chunk(make_chunk())
    with pytest.raises(InvalidStoreRequest):
        decode_chunk(data[:cut])
    with pytest.raises(InvalidStoreRequest):
        decode_chunk(b"XXXX" + data[4:])


def test_shape_mismatch_is_rejected() -> None:
    chunk = make_chunk()
    bad = ChunkEncoding(
        keys=chunk.keys,
        values=chunk.values,
        token_ids=chunk.token_ids[:-1],
        text="",
        embedding=chunk.embedding,
    )
    with pytest.raises(InvalidStoreRequest):
        encode_chunk(bad)


def test_chain_hash_depends_on_the_whole_prefix() -> None:
    a, b, c = [1, 2, 3], [4, 5], [6]
    h = chain_hashes([a, b, c])
    assert h[0] == chain_hash(None, a) and h[1] == chain_hash(h[0], b)
    assert chain_hashes([a, b, c]) == h  # deterministic
    # Same chunk tokens after a different prefix -> different key.
    assert chain_hashes([[9], b, c])[1] != h[1]
    assert chain_hash(None, np.array(a, dtype=np.int64)) == h[0]


async def test_chunks_and_manifests(backend: Backend) -> None:
    store = EncodingStore(backend)
    chunk = make_chunk()
    h = chain_hash(None, chunk.token_ids)
    assert not await store.has_chunk(FP, h)
    assert await store.put_chunk(FP, h, chunk) is True
    assert await store.has_chunk(FP, h)
    got = await store.get_chunk(FP, h)
    np.testing.assert_array_equal(got.keys[2], chunk.keys[2].astype(np.float16))
    with pytest.raises(NotFound):
        await store.get_chunk("other-model", h)

    manifest = DocumentManifest(
        doc_id="doc1", fingerprint=FP, chunk_hashes=(h,), name="a.txt", num_tokens=16
    )
    await store.put_manifest("s1", "doc1", manifest)
    stored = await store.get_manifest("s1", "doc1")
    assert stored.chunk_hashes == (h,) and stored.created_at > 0
    assert [m.doc_id for m in await store.list_documents("s1")] == ["doc1"]
    with pytest.raises(InvalidStoreRequest):
        await store.put_manifest("s1", "doc2", manifest)

    await store.delete_session("s1")
    assert await store.list_documents("s1") == []
    with pytest.raises(NotFound):
        await store.get_manifest("s1", "doc1")
    assert await store.has_chunk(FP, h)  # content-addressed chunks outlive the session


async def test_identical_document_is_stored_once_across_sessions(backend: Backend) -> None:
    store = EncodingStore(backend)
    chunks = [make_chunk(seed=i) for i in range(3)]
    hashes = chain_hashes([c.token_ids for c in chunks])
    written = []
    for session in ("alice", "bob"):
        for h, c in zip(hashes, chunks, strict=True):
            written.append(await store.put_chunk(FP, h, c))
        await store.put_manifest(
            session, "doc", DocumentManifest("doc", FP, tuple(hashes), num_tokens=48)
        )
    assert written == [True, True, True, False, False, False]
    a = await store.get_manifest("alice", "doc")
    b = await store.get_manifest("bob", "doc")
    assert a.chunk_hashes == b.chunk_hashes == tuple(hashes)
    for h in hashes:  # one stored copy per chunk
        assert await backend.list_paths(KeySpace.chunk(FP, h).tag) == ["chunk"]


async def test_collection_select_top_k(backend: Backend) -> None:
    store = EncodingStore(backend)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((50, 384)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    hashes = [f"h{i:03d}" for i in range(50)]
    await store.add_to_collection("wiki", FP, hashes[:30], emb[:30])
    await store.add_to_collection("wiki", FP, hashes[30:], emb[30:])
    query = emb[42] + 0.5 * emb[7]
    refs = await store.select_chunks("wiki", query, top_k=3)
    assert [r.chain_hash for r in refs][:2] == ["h042", "h007"]
    assert refs[0].score >= refs[1].score >= refs[2].score
    expected = np.sort(emb @ query)[::-1][:3]
    np.testing.assert_allclose([r.score for r in refs], expected, rtol=1e-5)
    # A batch added later is seen by the next select (cache refresh).
    await store.add_to_collection("wiki", FP, ["late"], query[None, :] / np.linalg.norm(query))
    assert (await store.select_chunks("wiki", query, top_k=1))[0].chain_hash == "late"
    await store.delete_collection("wiki")
    with pytest.raises(NotFound):
        await store.select_chunks("wiki", query, top_k=1)
