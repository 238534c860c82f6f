"""The Redis backend and the memory service on a real Redis Cluster (3 primaries, 3 replicas):
the URL, sessions spread over every primary, a slot migrated and a primary killed -9 while
writers run. Every acknowledged write reads back exactly; a write that failed either landed
whole or not at all; a failure is always StoreUnavailableError (HTTP 503), never wrong data.

The backend contract itself runs on the cluster too: `backend` in conftest.py has "redis-cluster".
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from redis.crc import key_slot

from memory_store.app import build_app
from memory_store.backends import RedisBackend
from memory_store.backends.redis_connections import ClusterAddress, parse_cluster_url
from memory_store.errors import InvalidStoreRequest, NotFound, StoreUnavailableError
from memory_store.keys import Key, KeySpace, redis_key
from memory_store.retry import RetryPolicy
from memory_store.settings import MemoryStoreSettings
from tests.redis_cluster import RedisClusterProcesses

from .conftest import HashingEncoder

PIECE = 16 * 1024
# Long enough to ride out a slot migration (TRYAGAIN/ASK for about a second), far shorter than
# a failover (2-3 s), so writes to a dead primary's slots fail rather than hang.
CLUSTER_RETRY = RetryPolicy(attempts=8, base_delay_s=0.02, max_delay_s=0.2)


def slot_of(tag: str) -> int:
    return int(key_slot(redis_key(tag, "index", "").encode()))


def tags_on(cluster: RedisClusterProcesses, ports: list[int], prefix: str) -> list[str]:
    """One session namespace ("sess:ID") whose slot is on each primary of `ports`, in order."""
    found: dict[int, str] = {}
    for i in itertools.count():
        namespace = f"sess:{prefix}{i}"
        found.setdefault(cluster.primary_of(slot_of(namespace)), namespace)
        if all(p in found for p in ports):
            return [found[p] for p in ports]
    raise AssertionError("unreachable")


@pytest.fixture
async def cluster_backend(redis_cluster: RedisClusterProcesses) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(
        redis_cluster.url,
        piece_bytes=PIECE,
        retry=CLUSTER_RETRY,
        socket_timeout_s=2.0,
        min_replicas_ack=1,
        replica_ack_timeout_s=0.5,
    )
    yield backend
    await backend.close()


@dataclass
class Ledger:
    """What writers were told, per (kind, key): the last acknowledged value, and the values of
    the writes after it that failed (each may have landed whole, or not at all)."""

    acked: dict[tuple[str, Key], Any] = field(default_factory=dict)
    unsure: dict[tuple[str, Key], list[Any]] = field(default_factory=dict)

    async def write(self, backend: RedisBackend, kind: str, key: Key, value: Any) -> bool:
        try:
            if kind == "blob":
                await backend.put_blob(key, value)
            else:
                await backend.put_record(key, value)
        except StoreUnavailableError:  # any other error fails the test
            self.unsure.setdefault((kind, key), []).append(value)
            return False
        self.acked[(kind, key)] = value
        self.unsure[(kind, key)] = []
        return True

    async def verify(self, backend: RedisBackend) -> None:
        for kind, key in self.acked.keys() | self.unsure.keys():
            try:
                got = await (backend.get_blob(key) if kind == "blob" else backend.get_record(key))
            except NotFound:
                got = None
            allowed = [self.acked.get((kind, key)), *self.unsure.get((kind, key), [])]
            assert got is not None or (kind, key) not in self.acked, f"lost {kind} {key}"
            assert got in allowed, f"{kind} {key} holds what no writer wrote"


async def keep_writing(
    backend: RedisBackend, ledger: Ledger, acks: dict[str, int], stop: asyncio.Event
) -> None:
    """One writer per namespace of `acks`, each overwriting a few blobs (3 pieces) and records
    until `stop` and counting in `acks` the writes acknowledged."""

    async def writer(ns: str) -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            blob = os.urandom(2 * PIECE + i + 1)
            ok = await ledger.write(backend, "blob", KeySpace.blob(ns, f"b{i % 3}"), blob)
            ok &= await ledger.write(backend, "rec", KeySpace.record(ns, f"r{i % 3}"), {"i": i})
            acks[ns] += ok
            await asyncio.sleep(0)

    await asyncio.gather(*(writer(ns) for ns in acks))


def test_cluster_urls() -> None:
    address = parse_cluster_url("rediss+cluster://app:p%40ss@10.0.0.1:7000,[::1]:7001,node-c")
    assert address == ClusterAddress(
        (("10.0.0.1", 7000), ("::1", 7001), ("node-c", 6379)), "app", "p@ss", tls=True
    )
    assert parse_cluster_url("redis+cluster://:pw@h:1/0").password == "pw"
    for bad in ("redis+cluster://h:1/2", "redis+cluster://h:x", "redis+cluster://", "redis://h"):
        with pytest.raises(InvalidStoreRequest):
            parse_cluster_url(bad)
    settings = MemoryStoreSettings(redis_url="redis+cluster://a:7000,b:7000")
    assert settings.backend_name == "redis"
    with pytest.raises(ValidationError):
        MemoryStoreSettings(redis_url="redis+cluster://a:7000/3")


async def test_sessions_spread_over_every_primary(
    redis_cluster: RedisClusterProcesses, cluster_backend: RedisBackend
) -> None:
    ledger = Ledger()
    namespaces = [f"sess:spread{i}" for i in range(30)]
    for i, ns in enumerate(namespaces):
        assert await ledger.write(cluster_backend, "blob", KeySpace.blob(ns, "t"), os.urandom(i))
        big = os.urandom(5 * PIECE + 1 + i)  # 6 pieces, all in the session's slot
        assert await ledger.write(cluster_backend, "blob", KeySpace.blob(ns, "big"), big)
        assert await ledger.write(cluster_backend, "rec", KeySpace.record(ns, "r"), {"i": i})
    await ledger.verify(cluster_backend)

    owners = {ns: redis_cluster.primary_of(slot_of(ns)) for ns in namespaces}
    assert set(owners.values()) == set(redis_cluster.primary_ports())  # all three hold sessions
    for ns, port in owners.items():
        with redis_cluster.client(port) as node:
            tag = KeySpace.namespace_tag(ns)
            assert node.exists(redis_key(tag, "index", "")), ns
            assert len(node.keys(f"longserve:{{{tag}}}:piece:*")) == 7
    assert sorted(await cluster_backend.list_paths(KeySpace.namespace_tag(namespaces[0]))) == [
        "blob/big",
        "blob/t",
        "rec/r",
    ]


async def test_slot_migration_while_sessions_are_written(
    redis_cluster: RedisClusterProcesses, cluster_backend: RedisBackend
) -> None:
    primaries = redis_cluster.primary_ports()
    moving, other = tags_on(redis_cluster, primaries[:2], "mig")
    slot, target = slot_of(moving), primaries[2]
    ledger = Ledger()
    for i in range(15):  # enough keys in the slot that the migration takes a while
        await ledger.write(cluster_backend, "blob", KeySpace.blob(moving, f"old{i}"), b"o" * i)

    stop, acks = asyncio.Event(), {moving: 0, other: 0}
    writer = asyncio.create_task(keep_writing(cluster_backend, ledger, acks, stop))
    await asyncio.sleep(0.2)
    before = dict(acks)
    await asyncio.to_thread(redis_cluster.migrate_slot, slot, target, 3, 0.03)
    during = dict(acks)
    await asyncio.sleep(0.3)
    stop.set()
    await writer

    assert redis_cluster.primary_of(slot) == target
    assert during[other] > before[other], (before, during)  # the other shard kept serving
    assert acks[moving] > during[moving], (during, acks)  # the moved session is written again
    await ledger.verify(cluster_backend)
    with redis_cluster.client(target) as node:
        assert node.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0


async def test_primary_killed_fails_over_keeping_acknowledged_writes(
    redis_cluster: RedisClusterProcesses, cluster_backend: RedisBackend
) -> None:
    primaries = redis_cluster.primary_ports()
    victim_ns, *other_ns = tags_on(redis_cluster, primaries, "fo")
    victim, slot = primaries[0], slot_of(victim_ns)
    replica = redis_cluster.replica_of(victim)
    ledger = Ledger()
    for i in range(20):
        await ledger.write(cluster_backend, "blob", KeySpace.blob(victim_ns, f"old{i}"), b"v" * i)
        await ledger.write(cluster_backend, "rec", KeySpace.record(victim_ns, f"old{i}"), {"i": i})
    assert len(ledger.acked) == 40

    stop, acks = asyncio.Event(), dict.fromkeys([victim_ns, *other_ns], 0)
    writer = asyncio.create_task(keep_writing(cluster_backend, ledger, acks, stop))
    await asyncio.sleep(0.3)
    redis_cluster.kill(victim)
    before = dict(acks)
    assert await asyncio.to_thread(redis_cluster.wait_failover, victim, slot) == replica
    await asyncio.sleep(0.3)
    stop.set()
    await writer
    assert all(acks[ns] > before[ns] for ns in other_ns), (before, acks)  # others kept serving

    await ledger.verify(cluster_backend)  # everything acknowledged survived, exactly

    # The promoted replica has no replica of its own: its writes are refused, never half-kept.
    with pytest.raises(StoreUnavailableError, match="replicas"):
        await cluster_backend.put_record(KeySpace.record(victim_ns, "late"), {"late": True})
    redis_cluster.restart(victim)  # rejoins as the replica of the one that took over
    await asyncio.to_thread(redis_cluster.wait_healthy)
    await cluster_backend.put_record(KeySpace.record(victim_ns, "late"), {"late": True})
    assert await cluster_backend.get_record(KeySpace.record(victim_ns, "late")) == {"late": True}


async def test_write_no_replica_confirms_is_refused(
    redis_cluster: RedisClusterProcesses, cluster_backend: RedisBackend
) -> None:
    key = KeySpace.record("sess:stalled", "r")
    replica = redis_cluster.replica_of(redis_cluster.primary_of(slot_of("sess:stalled")))
    redis_cluster.pause(replica)
    try:  # the primary has it, but a failover now could lose it: not acknowledged
        with pytest.raises(StoreUnavailableError, match="0 of 1 replicas"):
            await cluster_backend.put_record(key, {"v": 1})
    finally:
        redis_cluster.resume(replica)
    await cluster_backend.put_record(key, {"v": 2})
    assert await cluster_backend.get_record(key) == {"v": 2}


async def test_memory_service_on_cluster_answers_503_during_failover(
    redis_cluster: RedisClusterProcesses,
) -> None:
    settings = MemoryStoreSettings(
        redis_url=redis_cluster.url,
        redis_piece_bytes=PIECE,
        redis_replica_ack_timeout_s=0.5,
        retry_attempts=3,
        retry_base_delay_s=0.02,
    )
    backend = settings.build_backend()
    app = build_app(settings, backend=backend, encoder=HashingEncoder())
    victim_ns, other_ns = tags_on(redis_cluster, redis_cluster.primary_ports()[:2], "http")
    victim = redis_cluster.primary_of(slot_of(victim_ns))
    blobs = {
        (ns, f"b{i}"): os.urandom(3 * PIECE + i) for ns in (victim_ns, other_ns) for i in range(5)
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for (ns, key), data in blobs.items():
            assert (await http.put(f"/v1/blobs/{ns}/{key}", content=data)).status_code == 200
            assert (await http.put(f"/v1/records/{ns}/{key}", json={"n": len(data)})).is_success

        redis_cluster.kill(victim)
        failover = asyncio.create_task(
            asyncio.to_thread(redis_cluster.wait_failover, victim, slot_of(victim_ns))
        )
        statuses, unsure = [], {}
        for i in itertools.count():
            if failover.done():
                break
            r = await http.get(f"/v1/blobs/{victim_ns}/b1")
            statuses.append(r.status_code)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                assert r.content == blobs[(victim_ns, "b1")]
            else:
                assert r.json()["error"]["code"] == "memory_store_unavailable"
            data = os.urandom(PIECE + i)
            r = await http.put(f"/v1/blobs/{victim_ns}/new{i}", content=data)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                blobs[(victim_ns, f"new{i}")] = data
            else:
                unsure[f"new{i}"] = data
            r = await http.get(f"/v1/blobs/{other_ns}/b1")  # the other shards keep serving
            assert r.status_code == 200 and r.content == blobs[(other_ns, "b1")]
        await failover
        assert statuses[0] == 503 and unsure, statuses

        for (ns, key), data in blobs.items():
            r = await http.get(f"/v1/blobs/{ns}/{key}")
            assert r.status_code == 200 and r.content == data, (ns, key, r.status_code)
            if not key.startswith("new"):
                assert (await http.get(f"/v1/records/{ns}/{key}")).json() == {"n": len(data)}
        for key, data in unsure.items():  # refused writes: not there, or there whole
            r = await http.get(f"/v1/blobs/{victim_ns}/{key}")
            assert r.status_code == 404 or r.content == data, r.status_code
        assert (await http.get("/ready")).status_code == 200
    await backend.close()
