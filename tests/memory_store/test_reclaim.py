"""The store gives back what nothing uses (issue #41 item 3), on the embedded store's files and a
real redis-server: a deleted session leaves nothing behind, expiry is the store's, unnamed chunks
go after their grace, and a full Redis answers 503 `memory_store_full`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from memory_store.app import build_app
from memory_store.backends import Backend, EmbeddedBackend, RedisBackend
from memory_store.client import MemoryStoreClient, http_client, in_process_client
from memory_store.encodings import DocumentManifest
from memory_store.errors import StoreFull
from memory_store.keys import KeySpace
from memory_store.settings import MemoryStoreSettings
from tests.helpers import free_port, wait_for_process, wait_until
from tests.memory_store.conftest import FAST_RETRY, HashingEncoder
from tests.memory_store.test_auth import REPO, TOKEN, env_with, memory_store_command
from tests.memory_store.test_encodings import make_chunk
from tests.redis_process import RedisProcess

FP = "fp-model"
TENANT_A, TENANT_B = "aaaaaaaaaaaa", "bbbbbbbbbbbb"


@pytest.fixture(params=["embedded", "redis", "redis_cluster"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


@pytest.fixture
async def client(backend: Backend) -> AsyncIterator[MemoryStoreClient]:
    c = in_process_client(backend, encoder=HashingEncoder())
    yield c


async def store_bytes(backend: Backend) -> int:
    """Every byte the backend holds: files on disk, or Redis's keys' values."""
    if isinstance(backend, EmbeddedBackend):
        return sum(f.stat().st_size for f in Path(backend.root).rglob("*") if f.is_file())
    total = 0
    for prefix in ("sess:", "tenant:", "coll:", "enc:"):
        for tag in await backend.list_tags(prefix):
            total += await backend.tag_bytes(tag)
    return total


async def store_keys(backend: Backend) -> int:
    if isinstance(backend, EmbeddedBackend):
        return sum(1 for f in Path(backend.root).rglob("*") if f.is_file())
    return int(await backend._client.dbsize())


async def write_session(
    client: MemoryStoreClient, tenant: str, sid: str, hashes: list[str], *, last_used: float
) -> None:
    """What a server and its engine write for one session with one document."""
    ns = f"sess:{tenant}.{sid}"
    for i, h in enumerate(hashes):
        await client.put_chunk(FP, h, make_chunk(seed=i, t=64))
    await client.put_manifest(f"{tenant}.{sid}", "d1", DocumentManifest("d1", FP, tuple(hashes)))
    await client.put_record(
        ns,
        "session",
        {"id": sid, "tenant": tenant, "created_at": last_used, "ttl_seconds": 60,
         "last_used": last_used},
    )  # fmt: skip
    await client.put_record(ns, "doc.d1", {"id": "d1", "status": "ready"})
    await client.put_blob(ns, "text.d1", b"the document's text " * 1000)
    await client.put_blob(ns, "turnkv.t1", b"\x00" * 50_000)
    await client.put_record(f"tenant:{tenant}", sid, {"id": sid})


async def test_deleting_a_session_leaves_nothing_it_alone_used(
    backend: Backend, client: MemoryStoreClient
) -> None:
    empty = await store_bytes(backend), await store_keys(backend)
    now = time.time()
    await write_session(client, TENANT_A, "keep", ["h-shared"], last_used=now)
    kept = await store_bytes(backend)
    await write_session(client, TENANT_A, "gone", ["h-shared", "h-own1", "h-own2"], last_used=now)
    await client.put_chunk(FP, "h-coll", make_chunk(seed=9, t=64))
    await client.add_to_collection("manual", FP, ["h-coll"], np.ones((1, 4), np.float32))
    await write_session(client, TENANT_B, "other", ["h-coll"], last_used=now)
    assert await store_bytes(backend) > kept

    await client.delete_session(f"{TENANT_A}.gone")
    await client.delete_record(f"tenant:{TENANT_A}", "gone")  # the server's second step
    await client.delete_session(f"{TENANT_B}.other")
    await client.delete_record(f"tenant:{TENANT_B}", "other")

    assert not await client.has_chunk(FP, "h-own1") and not await client.has_chunk(FP, "h-own2")
    assert await client.has_chunk(FP, "h-shared")  # the sibling session of A names it
    assert await client.has_chunk(FP, "h-coll")  # the collection names it
    assert await client.list_records(f"sess:{TENANT_A}.gone") == {}
    assert await backend.list_paths(KeySpace.session_tag(f"{TENANT_A}.gone")) == []
    await client.delete_session(f"{TENANT_A}.keep")
    await client.delete_record(f"tenant:{TENANT_A}", "keep")
    await client.delete_collection("manual")
    await client.reclaim(chunk_grace_s=0)  # the collection's chunk: named by nothing now
    assert (await store_bytes(backend), await store_keys(backend)) == empty


async def test_the_store_expires_sessions_no_replica_holds(
    backend: Backend, client: MemoryStoreClient
) -> None:
    now = time.time()
    await write_session(client, TENANT_A, "old", ["h1", "h2"], last_used=now - 120)
    await write_session(client, TENANT_A, "new", ["h3"], last_used=now)
    await client.put_chunk(FP, "h-prefix", make_chunk(seed=5))  # named by nothing (a cache)

    report = await client.reclaim(chunk_grace_s=3600)
    assert report["sessions_deleted"] == 1 and report["chunks_deleted"] == 2
    assert report["bytes_reclaimed"] > 50_000
    assert await client.list_records(f"sess:{TENANT_A}.old") == {}
    assert set(await client.list_records(f"tenant:{TENANT_A}")) == {"new"}
    assert await client.has_chunk(FP, "h3") and await client.has_chunk(FP, "h-prefix")
    assert (await client.reclaim(chunk_grace_s=3600))["bytes_reclaimed"] == 0  # idempotent

    report = await client.reclaim(chunk_grace_s=0)
    assert report["chunks_deleted"] == 1 and not await client.has_chunk(FP, "h-prefix")
    assert await client.has_chunk(FP, "h3")


async def test_several_sweeps_at_once_delete_each_thing_once(
    backend: Backend, client: MemoryStoreClient
) -> None:
    """Replicas and the memory service sweep the same store at the same time."""
    for i in range(4):
        await write_session(client, TENANT_A, f"old{i}", [f"h{i}a", f"h{i}b"], last_used=0)
    others = [in_process_client(backend, encoder=HashingEncoder()) for _ in range(3)]
    reports = await asyncio.gather(*(c.reclaim(chunk_grace_s=0) for c in [client, *others]))
    assert sum(r["sessions_deleted"] for r in reports) == 4
    assert sum(r["chunks_deleted"] for r in reports) == 8
    assert await client.list_records(f"tenant:{TENANT_A}") == {}
    assert await backend.list_tags("enc:") == [] and await backend.list_tags("sess:") == []


async def test_embedded_files_shrink(tmp_path: Path) -> None:
    backend = EmbeddedBackend(tmp_path / "store")
    client = in_process_client(backend, encoder=HashingEncoder())
    await write_session(client, TENANT_A, "s", [f"h{i}" for i in range(20)], last_used=0)

    def disk() -> int:
        return sum(os.stat(p).st_blocks * 512 for p in (tmp_path / "store").rglob("*"))

    before = disk()
    report = await client.reclaim(chunk_grace_s=3600)
    assert report["sessions_deleted"] == 1 and report["chunks_deleted"] == 20
    assert disk() < before / 10  # files deleted, not emptied: the file system has them back


@pytest.fixture
def tiny_redis(tmp_path: Path, redis_server: RedisProcess) -> RedisProcess:
    """The test's redis-server, capped as docker-compose.yml ships it (noeviction)."""
    import redis

    r = redis.Redis(port=redis_server.port)
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory", used + 1_500_000)
    r.config_set("maxmemory-policy", "noeviction")
    r.close()
    return redis_server


async def test_a_full_redis_answers_503_and_deletes_make_room(
    tiny_redis: RedisProcess, tmp_path: Path
) -> None:
    backend = RedisBackend(tiny_redis.url, retry=FAST_RETRY, socket_timeout_s=2.0)
    client = in_process_client(backend, encoder=HashingEncoder())
    ns = f"sess:{TENANT_A}.s"
    with pytest.raises(StoreFull):
        for i in range(100):
            await client.put_blob(ns, f"text.d{i}", os.urandom(100_000))
    written = [k for k in await backend.list_paths(KeySpace.namespace_tag(ns))]
    assert len(written) == i  # the refused write left nothing behind
    for k in written:
        data = await client.get_blob(ns, k.removeprefix("blob/"))
        assert len(data) == 100_000  # acknowledged writes are all there: nothing evicted

    app = build_app(
        MemoryStoreSettings(redis_url=tiny_redis.url, reclaim_interval_s=0),
        backend=backend,
        encoder=HashingEncoder(),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as http:
        r = await http.put(f"/v1/blobs/{ns}/text.more", content=os.urandom(100_000))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "memory_store_full"
        assert "OOM" not in r.text and "maxmemory'" not in r.text
        r = await http.delete(f"/v1/sessions/{TENANT_A}.s")  # deletes work on a full store
        assert r.status_code == 200 and r.json()["bytes_reclaimed"] >= i * 100_000
        r = await http.put(f"/v1/blobs/{ns}/text.more", content=os.urandom(100_000))
        assert r.status_code == 200
    await backend.close()


def test_the_memory_service_sweeps_by_itself(tmp_path: Path) -> None:
    """A real `longserve memory-store` expires a session no server will ever sweep again."""
    port = free_port()
    env = {**env_with(TOKEN), "LONGSERVE_MEMORY_STORE_RECLAIM_INTERVAL_S": "0.3"}
    log = tmp_path / "memory-store.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            memory_store_command(port, tmp_path / "store"),
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_process(proc, f"{url}/health", lambda: log.read_text(errors="replace"), 60)
        client = http_client(url, token=TOKEN)

        async def write() -> None:
            await write_session(client, TENANT_A, "old", ["h1"], last_used=time.time() - 3600)
            await write_session(client, TENANT_A, "new", ["h2"], last_used=time.time())
            await client.close()

        asyncio.run(write())
        store = tmp_path / "store"
        wait_until(
            lambda: not [p for p in store.rglob("*") if "old" in p.name or "h1" in p.name],
            lambda: f"not swept:\n{log.read_text(errors='replace')}",
            30,
            0.1,
        )
        assert [p for p in store.rglob("*") if ".new" in str(p)]
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'longserve:memory_store_reclaimed_total{kind="sessions"} 1.0' in metrics
    finally:
        proc.kill()
        proc.wait(timeout=10)
