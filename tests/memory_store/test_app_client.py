"""The HTTP service and both client implementations, over real backends."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from memory_store.app import build_app
from memory_store.backends import Backend, EmbeddedBackend, RedisBackend
from memory_store.cli import add_arguments, settings_from_args
from memory_store.client import (
    MemoryStoreClient,
    embedded_client,
    http_client,
    in_process_client,
    wait_until_ready,
)
from memory_store.encodings import DocumentManifest, chain_hashes
from memory_store.errors import InvalidStoreRequest, NotFound, StoreUnavailableError
from memory_store.keys import KeySpace
from memory_store.retry import RetryPolicy
from memory_store.settings import MemoryStoreSettings
from tests.helpers import ThreadedServer, free_port
from tests.redis_process import RedisProcess

from .conftest import FAST_RETRY, HashingEncoder
from .test_encodings import FP, make_chunk

FAST_HTTP_RETRY = RetryPolicy(attempts=3, base_delay_s=0.02, max_delay_s=0.1)


def settings(tmp_path: Path, **kw: object) -> MemoryStoreSettings:
    return MemoryStoreSettings(data_dir=tmp_path / "unused", **kw)  # type: ignore[arg-type]


def asgi_client(app, calls: list[tuple[str, str, str]] | None = None) -> MemoryStoreClient:
    def hook(op: str, backend: str, status: str, seconds: float) -> None:
        if calls is not None:
            calls.append((op, backend, status))

    return http_client(
        "http://memory-store",
        transport=httpx.ASGITransport(app=app),
        retry=FAST_HTTP_RETRY,
        on_request=hook,
    )


@pytest.fixture(params=["in_process", "http"])
async def client(
    request: pytest.FixtureRequest, backend: Backend, tmp_path: Path
) -> AsyncIterator[tuple[MemoryStoreClient, list[tuple[str, str, str]]]]:
    calls: list[tuple[str, str, str]] = []
    if request.param == "in_process":
        c = in_process_client(
            backend,
            encoder=HashingEncoder(),
            on_request=lambda op, b, s, t: calls.append((op, b, s)),
        )
    else:
        c = asgi_client(
            build_app(settings(tmp_path), backend=backend, encoder=HashingEncoder()), calls
        )
    yield c, calls
    if request.param == "http":
        await c.close()


async def test_client_round_trip(client: tuple[MemoryStoreClient, list]) -> None:
    c, calls = client
    await c.ping()
    chunks = [make_chunk(seed=i) for i in range(2)]
    hashes = chain_hashes([ch.token_ids for ch in chunks])
    assert await c.put_chunk(FP, hashes[0], chunks[0]) is True
    assert await c.put_chunk(FP, hashes[0], chunks[0]) is False
    assert await c.put_chunk(FP, hashes[1], chunks[1], quantization="int8") is True
    assert await c.has_chunk(FP, hashes[0]) and not await c.has_chunk(FP, "0" * 64)
    got = await c.get_chunk(FP, hashes[0])
    np.testing.assert_array_equal(got.values[1], chunks[0].values[1].astype(np.float16))
    assert got.text == chunks[0].text
    with pytest.raises(NotFound):
        await c.get_chunk(FP, "0" * 64)

    await c.put_manifest("sess-1", "doc", DocumentManifest("doc", FP, tuple(hashes), "d.txt", 32))
    assert (await c.get_manifest("sess-1", "doc")).chunk_hashes == tuple(hashes)
    assert [m.name for m in await c.list_documents("sess-1")] == ["d.txt"]

    emb = np.stack([ch.embedding for ch in chunks])
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    assert await c.add_to_collection("books", FP, hashes, emb) == 2
    refs = await c.select_chunks("books", emb[1], top_k=1)
    assert refs[0].chain_hash == hashes[1] and refs[0].score == pytest.approx(1.0, abs=1e-5)

    text = "The grass is green. The pass key is 9054. Remember it."
    assert await c.larimar_write("sess-1", text=text, save=True) == 3
    hits = await c.larimar_read("sess-1", "The pass key is", top_k=2)
    assert hits[0].texts == ("The pass key is 9054.",)
    assert (await c.larimar_load("sess-1"))["segments"] == 3

    assert await c.delete_session("sess-1") >= 2
    assert await c.list_documents("sess-1") == []
    with pytest.raises(NotFound):
        await c.larimar_read("sess-1", "The pass key is")
    with pytest.raises(InvalidStoreRequest):
        await c.get_manifest("bad id!", "doc")

    statuses = {(op, status) for op, _, status in calls}
    assert ("put_chunk", "ok") in statuses and ("get_chunk", "not_found") in statuses


async def test_metrics_and_probes(embedded_backend: EmbeddedBackend, tmp_path: Path) -> None:
    app = build_app(settings(tmp_path), backend=embedded_backend, encoder=HashingEncoder())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        assert (await h.get("/health")).json() == {"status": "ok"}
        assert (await h.get("/ready")).status_code == 200
        assert (await h.get(f"/v1/chunks/{FP}/{'0' * 64}")).status_code == 404
        text = (await h.get("/metrics")).text
    assert (
        'longserve:memory_store_requests_total{backend="embedded",op="get_chunk",status="not_found"} 1.0'
        in text
    )
    assert (
        'longserve:memory_store_request_seconds_bucket{backend="embedded",le="0.001",op="ping"}'
        in text
    )


async def test_bad_input_is_an_openai_shaped_4xx(
    embedded_backend: EmbeddedBackend, tmp_path: Path
) -> None:
    app = build_app(settings(tmp_path, max_blob_bytes=2048), backend=embedded_backend)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        r = await h.put(f"/v1/chunks/{FP}/abc", content=b"not a chunk")
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = await h.put(f"/v1/chunks/{FP}/abc", content=b"x" * 5000)
        assert r.status_code == 413
        r = await h.post("/v1/sessions/s/larimar/read", json={"top_k": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "query"
    assert not await embedded_backend.has_blob(KeySpace.chunk(FP, "abc"))


async def test_backend_down_is_503_and_recovers(redis_server: RedisProcess, tmp_path: Path) -> None:
    backend = RedisBackend(redis_server.url, retry=FAST_RETRY, socket_timeout_s=1.0)
    app = build_app(settings(tmp_path), backend=backend, encoder=HashingEncoder())
    c = asgi_client(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        chunk = make_chunk()
        [h0] = chain_hashes([chunk.token_ids])
        await c.put_chunk(FP, h0, chunk)

        redis_server.kill()
        r = await h.get("/ready")
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "memory_store_unavailable"
        r = await h.get(f"/v1/chunks/{FP}/{h0}")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        with pytest.raises(StoreUnavailableError):
            await c.get_chunk(FP, h0)

        redis_server.start()
        assert (await h.get("/ready")).status_code == 200
        got = await c.get_chunk(FP, h0)  # acknowledged before the kill -> still there (AOF)
        np.testing.assert_array_equal(got.keys[0], chunk.keys[0].astype(np.float16))
    await c.close()
    await backend.close()


async def test_http_client_reconnects_after_service_restart(tmp_path: Path) -> None:
    port = free_port()
    app = build_app(
        settings(tmp_path), backend=EmbeddedBackend(tmp_path / "store"), encoder=HashingEncoder()
    )
    server = ThreadedServer.of(app, port, lifespan="off")
    server.start()
    c = http_client(f"http://127.0.0.1:{port}", retry=FAST_HTTP_RETRY, timeout_s=5)
    try:
        manifest = DocumentManifest("d", FP, ("h1",))
        await c.put_manifest("s", "d", manifest)
        await asyncio.to_thread(server.stop)
        with pytest.raises(StoreUnavailableError) as info:
            await c.get_manifest("s", "d")
        assert isinstance(info.value.__cause__, httpx.TransportError)
        await asyncio.to_thread(server.start)
        await wait_until_ready(c, timeout_s=5)
        assert (await c.get_manifest("s", "d")).chunk_hashes == ("h1",)
    finally:
        await c.close()
        await asyncio.to_thread(server.stop)


def test_cli_arguments_build_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("LONGSERVE_MEMORY_STORE_REDIS_URL", "redis://from-env:6379/0")
    s = settings_from_args(parser.parse_args(["--port", "9001", "--data-dir", str(tmp_path)]))
    assert (s.port, s.data_dir, s.redis_url, s.backend_name) == (9001, tmp_path, None, "embedded")
    s = settings_from_args(parser.parse_args([]))
    assert (s.port, s.redis_url, s.backend_name) == (8001, "redis://from-env:6379/0", "redis")
    with pytest.raises(SystemExit):
        parser.parse_args(["--redis-url", "redis://x", "--data-dir", "/tmp/x"])
    with pytest.raises(ValidationError):
        MemoryStoreSettings(redis_url="redis://x", data_dir=tmp_path)
    with pytest.raises(ValidationError):
        MemoryStoreSettings(redis_url="http://x")


async def test_records_and_blobs_round_trip(client: tuple[MemoryStoreClient, list]) -> None:
    c, calls = client
    ns = "sess:tenant1.sess_a"
    await c.put_record(ns, "session", {"id": "sess_a", "n": 1, "text": "héllo"})
    await c.put_record(ns, "doc.d1", {"id": "d1"})
    await c.put_record(ns, "doc.d2", {"id": "d2"})
    await c.put_blob(ns, "text.d1", "some text, ünïcode".encode())
    assert await c.get_record(ns, "session") == {"id": "sess_a", "n": 1, "text": "héllo"}
    assert await c.list_records(ns, "doc.") == {"doc.d1": {"id": "d1"}, "doc.d2": {"id": "d2"}}
    assert set(await c.list_records(ns)) == {"session", "doc.d1", "doc.d2"}  # blobs not listed
    assert (await c.get_blob(ns, "text.d1")).decode() == "some text, ünïcode"
    await c.put_record(ns, "doc.d1", {"id": "d1", "status": "ready"})  # replace
    assert (await c.get_record(ns, "doc.d1"))["status"] == "ready"

    assert await c.delete_record(ns, "doc.d2") is True
    assert await c.delete_record(ns, "doc.d2") is False
    with pytest.raises(NotFound):
        await c.get_record(ns, "doc.d2")
    with pytest.raises(NotFound):
        await c.get_blob(ns, "text.none")
    assert await c.list_records("tenant:nobody") == {}

    # The session's namespace is its hash tag: deleting the session deletes its records.
    await c.put_record("tenant:tenant1", "sess_a", {"id": "sess_a"})
    assert await c.delete_session("tenant1.sess_a") >= 3
    assert await c.list_records(ns) == {}
    with pytest.raises(NotFound):
        await c.get_blob(ns, "text.d1")
    assert await c.list_records("tenant:tenant1") == {"sess_a": {"id": "sess_a"}}

    for bad_ns, bad_key in (("sess", "k"), ("other:x", "k"), ("sess:a/b", "k"), (ns, "a/b")):
        with pytest.raises(InvalidStoreRequest):
            await c.put_record(bad_ns, bad_key, {"x": 1})
    assert ("get_record", "not_found") in {(op, status) for op, _, status in calls}


async def test_records_live_under_the_session_hash_tag(redis_backend: RedisBackend) -> None:
    c = in_process_client(redis_backend, encoder=HashingEncoder())
    await c.put_record("sess:t.s1", "session", {"id": "s1"})
    await c.put_blob("sess:t.s1", "text.d", b"abc")
    await c.put_manifest("t.s1", "doc", DocumentManifest("doc", FP, ("h1",)))
    keys = sorted(k.decode() for k in await redis_backend._client.keys("longserve:*"))
    assert keys and all(k.startswith("longserve:{sess:t.s1}:") for k in keys), keys


async def test_collection_chunks_in_document_order(client: tuple[MemoryStoreClient, list]) -> None:
    c, _ = client
    emb = np.eye(4, dtype=np.float32)
    await c.add_to_collection("books", FP, ["a1", "a2"], emb[:2])
    await c.add_to_collection("books", FP, ["b1", "b2"], emb[2:])
    refs = await c.collection_chunks("books")
    assert [r.chain_hash for r in refs] == ["a1", "a2", "b1", "b2"]
    with pytest.raises(NotFound):
        await c.collection_chunks("nothing-here")


async def test_embedded_client_stores_under_its_data_dir(tmp_path: Path) -> None:
    c = embedded_client(tmp_path / "store", encoder=HashingEncoder())
    assert c.backend_name == "embedded" and (tmp_path / "store").is_dir()
    await c.put_record("sess:s1", "session", {"id": "s1"})
    again = embedded_client(tmp_path / "store", encoder=HashingEncoder())
    assert await again.get_record("sess:s1", "session") == {"id": "s1"}
    await c.close()
    await again.close()


def test_client_module_exports_what_server_and_engine_use() -> None:
    import memory_store.client as api

    for name in (
        "MemoryStoreClient",
        "ChunkEncoding",
        "ChunkRef",
        "DocumentManifest",
        "chain_hash",
        "KeySpace",
        "TextEncoder",
        "default_embedder",
        "LarimarConfig",
        "LarimarHit",
        "split_sentences",
    ):
        assert name in api.__all__ and hasattr(api, name), name


def test_client_default_embedder_follows_the_embedder_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import memory_store.client as api
    import memory_store.embedder

    encoder = HashingEncoder()
    monkeypatch.setattr(memory_store.embedder, "default_embedder", lambda: encoder)
    assert api.default_embedder() is encoder


async def test_a_reading_cut_short_drops_the_chunks_nothing_names(
    client: tuple[MemoryStoreClient, list],
) -> None:
    """`drop_unnamed_chunks`, in process and through the route: the chunks a cut-short reading
    put go, unless a manifest of the tenant's sessions names them; bad ids are a clean 4xx."""
    c, _ = client
    for i, h in enumerate(["h-named", "h-own"]):
        await c.put_chunk(FP, h, make_chunk(seed=i))
    await c.put_manifest("ta.s2", "d1", DocumentManifest("d1", FP, ("h-named",)))
    assert await c.drop_unnamed_chunks("ta.s1", FP, ["h-named", "h-own"]) == 1
    assert await c.has_chunk(FP, "h-named") and not await c.has_chunk(FP, "h-own")
    with pytest.raises(InvalidStoreRequest):
        await c.drop_unnamed_chunks("ta.s1", FP, ["../x"])
