"""Both backends: round trips, listing, errors; Redis pieces and hash tags; crash safety."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from redis.crc import key_slot

from memory_store.backends import Backend, EmbeddedBackend, RedisBackend
from memory_store.errors import Conflict, InvalidStoreRequest, NotFound, StoreUnavailableError
from memory_store.keys import Key, KeySpace
from tests.redis_process import RedisProcess

from .conftest import FAST_RETRY


async def test_blob_and_record_round_trip(backend: Backend) -> None:
    key = KeySpace.manifest("s1", "d1")
    await backend.put_blob(key, b"\x00\x01hello")
    await backend.put_record(key, {"a": 1, "text": "héllo"})
    assert await backend.get_blob(key) == b"\x00\x01hello"
    assert await backend.get_record(key) == {"a": 1, "text": "héllo"}
    assert await backend.has_blob(key)
    await backend.put_blob(key, b"second")  # overwrite
    assert await backend.get_blob(key) == b"second"
    assert await backend.list_paths(key.tag) == ["doc/d1"]
    assert await backend.delete(key)
    assert not await backend.has_blob(key)
    with pytest.raises(NotFound):
        await backend.get_blob(key)
    with pytest.raises(NotFound):
        await backend.get_record(key)
    assert not await backend.delete(key)


async def test_empty_blob(backend: Backend) -> None:
    key = KeySpace.larimar("s")
    await backend.put_blob(key, b"")
    assert await backend.get_blob(key) == b""


async def test_create_only_record_conflicts(backend: Backend) -> None:
    key = KeySpace.manifest("s1", "d1")
    await backend.put_record(key, {"v": 1}, if_absent=True)
    with pytest.raises(Conflict):
        await backend.put_record(key, {"v": 2}, if_absent=True)
    assert await backend.get_record(key) == {"v": 1}


async def test_list_and_delete_tag(backend: Backend) -> None:
    for doc in ("a", "b", "c"):
        await backend.put_record(KeySpace.manifest("s1", doc), {"doc": doc})
    await backend.put_blob(KeySpace.larimar("s1"), b"x" * 1000)
    await backend.put_record(KeySpace.manifest("s2", "a"), {"doc": "a"})
    tag = KeySpace.session_tag("s1")
    assert await backend.list_paths(tag, "doc/") == ["doc/a", "doc/b", "doc/c"]
    assert await backend.list_paths(tag) == ["doc/a", "doc/b", "doc/c", "larimar"]
    assert await backend.delete_tag(tag) == 4
    assert await backend.list_paths(tag) == []
    assert await backend.get_record(KeySpace.manifest("s2", "a")) == {"doc": "a"}


@pytest.mark.parametrize("bad", ["", "a/b", "{x}", "a b", "../etc", "x" * 300])
def test_ids_are_validated(bad: str) -> None:
    with pytest.raises(InvalidStoreRequest):
        KeySpace.manifest(bad, "d")


async def test_redis_blobs_are_chunked_under_one_hash_tag(
    redis_backend: RedisBackend, redis_server: RedisProcess
) -> None:
    import redis.asyncio as aioredis

    payload = os.urandom(64 * 1024 * 5 + 123)  # 6 pieces of 64 KiB
    await redis_backend.put_blob(KeySpace.larimar("sessA"), payload)
    await redis_backend.put_record(KeySpace.manifest("sessA", "doc1"), {"n": 1})
    assert await redis_backend.get_blob(KeySpace.larimar("sessA")) == payload

    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = [k.decode() for k in await raw.keys("*")]
        pieces = [k for k in keys if ":piece:" in k]
        assert len(pieces) == 6
        sizes = [await raw.strlen(k) for k in pieces]
        assert max(sizes) == 64 * 1024 and sum(sizes) == len(payload)
        assert all("{sess:sessA}" in k for k in keys)
        assert len({key_slot(k.encode()) for k in keys}) == 1
        # Overwriting leaves no orphaned pieces of the old version.
        await redis_backend.put_blob(KeySpace.larimar("sessA"), b"small")
        assert len([k for k in await raw.keys("*") if b":piece:" in k]) == 1
    finally:
        await raw.aclose()


async def test_redis_down_raises_unavailable_then_recovers(redis_server: RedisProcess) -> None:
    backend = RedisBackend(
        redis_server.url, retry=FAST_RETRY, piece_bytes=1024, socket_timeout_s=1.0
    )
    try:
        key = KeySpace.larimar("durable")
        acknowledged = os.urandom(10_000)
        await backend.put_blob(key, acknowledged)
        await backend.put_record(KeySpace.manifest("durable", "d"), {"ok": True})

        redis_server.kill()
        with pytest.raises(StoreUnavailableError) as info:
            await backend.get_blob(key)
        assert info.value.__cause__ is not None
        with pytest.raises(StoreUnavailableError):
            await backend.ping()

        redis_server.start()  # same port, same dir: AOF replays what was acknowledged
        await backend.ping()
        assert await backend.get_blob(key) == acknowledged
        assert await backend.get_record(KeySpace.manifest("durable", "d")) == {"ok": True}
    finally:
        await backend.close()


async def test_embedded_write_that_dies_before_rename_leaves_old_value(
    embedded_backend: EmbeddedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = KeySpace.larimar("s")
    await embedded_backend.put_blob(key, b"old" * 1000)

    def crash(*args: object) -> None:
        raise KeyboardInterrupt("simulated crash between fsync and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        await embedded_backend.put_blob(key, b"new" * 1000)
    monkeypatch.undo()
    assert await embedded_backend.get_blob(key) == b"old" * 1000
    assert await embedded_backend.list_paths(key.tag) == ["larimar"]


_WRITER = textwrap.dedent(
    """
    import asyncio, hashlib, sys
    from memory_store.backends import EmbeddedBackend
    from memory_store.keys import KeySpace

    async def main():
        backend = EmbeddedBackend(sys.argv[1])
        i = 0
        while True:
            body = bytes([i % 251]) * (3_000_000 + i)
            await backend.put_blob(KeySpace.larimar("crash"), hashlib.sha256(body).digest() + body)
            i += 1
            if i == 2:
                print("ready", flush=True)

    asyncio.run(main())
    """
)


async def test_embedded_blob_survives_kill_9_mid_write(tmp_path: Path) -> None:
    import hashlib

    data_dir = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(data_dir)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        await asyncio.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    blob = await EmbeddedBackend(data_dir).get_blob(KeySpace.larimar("crash"))
    digest, body = blob[:32], blob[32:]
    assert hashlib.sha256(body).digest() == digest  # a whole version, never a torn one


def test_key_rejects_brace_in_tag() -> None:
    with pytest.raises(InvalidStoreRequest):
        Key("sess:{x}", "p")


async def test_unreachable_redis_fails_fast_with_unavailable() -> None:
    from tests.helpers import free_port

    backend = RedisBackend(f"redis://127.0.0.1:{free_port()}/0", retry=FAST_RETRY)
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError):
        await backend.put_blob(KeySpace.larimar("s"), b"x")
    assert time.monotonic() - start < 5
    await backend.close()


async def test_concurrent_overwrites_leave_one_whole_blob_and_no_orphans(
    redis_backend: RedisBackend, redis_server: RedisProcess
) -> None:
    import redis.asyncio as aioredis

    key = KeySpace.larimar("race")
    bodies = [bytes([i]) * (64 * 1024 * 3 + i) for i in range(8)]
    await asyncio.gather(*(redis_backend.put_blob(key, b) for b in bodies))
    final = await redis_backend.get_blob(key)
    assert final in bodies
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        pieces = [k for k in await raw.keys("*") if b":piece:" in k]
    finally:
        await raw.aclose()
    assert len(pieces) == -(-len(final) // (64 * 1024))


async def test_long_fingerprints_fit_in_file_names(embedded_backend: EmbeddedBackend) -> None:
    key = KeySpace.chunk("f" * 200, "a" * 64)
    await embedded_backend.put_blob(key, b"x")
    assert await embedded_backend.get_blob(key) == b"x"
    assert await embedded_backend.list_paths(key.tag) == ["chunk"]
