"""The Redis backend: keys `longserve:{<tag>}:<kind>:<path>`, so Redis Cluster keeps a whole
session (`{sess:ID}`), collection (`{coll:NAME}`) or chunk in one slot.

One server (`redis://`, `rediss://`, `unix://`) or a Redis Cluster
(`redis+cluster://host:port[,host:port...]`), by the URL; see `redis_connections`.

Blobs are split into pieces of a few MB written under a fresh version and published by swapping
a small header, so a reader never sees half of a blob. Every write runs on the primary that owns
its slot; with `min_replicas_ack` it returns only once that many replicas have it (WAIT), so that
a failover to a replica keeps every acknowledged write. Transient failures (lost connections, a
failover or resharding in progress) are retried with backoff (`memory_store.retry`) and then
raise StoreUnavailableError.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from memory_store.backends.base import Backend, JsonSerializer, Serializer
from memory_store.backends.redis_connections import RedisConnections, is_cluster_url
from memory_store.errors import (
    Conflict,
    InvalidStoreRequest,
    NotFound,
    StoreError,
    StoreUnavailableError,
)
from memory_store.keys import Key, redis_key
from memory_store.retry import RetryPolicy, retrying

T = TypeVar("T")

DEFAULT_PIECE_BYTES = 4 * 1024 * 1024

# KEYS: header, index, piece 1..n. ARGV: version, n, size, index member, piece 1..n.
# One atomic step in one slot: the new pieces, then the header swap, returning the header it
# replaced so that concurrent writers each drop exactly what they replaced. Readers see the old
# blob or the new one, never a mix.
# Not MULTI: WAIT cannot go inside one, and redis-py 8 runs an async cluster transaction's
# every queued command through asyncio.run in a new thread.
_PUBLISH_BLOB = """
for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[i + 2]) end
local old = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'pieces', ARGV[2], 'size', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return old
"""

# KEYS: record, index. ARGV: data, "1" for create-only, index member. 0 when create-only lost.
_PUT_RECORD = """
if ARGV[2] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""


def _bytes(value: bytes | str | None) -> bytes:
    if value is None:
        raise StoreError("redis returned nothing where a value was expected")
    return value.encode() if isinstance(value, str) else value


def _header(raw: Mapping[Any, Any] | list[Any]) -> dict[str, str]:
    """A hash as HGETALL answers it: a mapping from redis-py, a flat list from a script."""
    pairs = raw.items() if isinstance(raw, Mapping) else zip(raw[::2], raw[1::2], strict=True)
    return {_bytes(k).decode(): _bytes(v).decode() for k, v in pairs}


class RedisBackend(Backend):
    """redis.asyncio over one URL (a server or a cluster). Blobs in pieces of `piece_bytes`,
    published atomically.

    Layout, all under the key's hash tag:
      `longserve:{T}:blob:P`        header hash {version, pieces, size}
      `longserve:{T}:piece:P:V:i`   piece i of version V
      `longserve:{T}:rec:P`         serialized record
      `longserve:{T}:index`         set of "blob:P" / "rec:P" (listing without SCAN)

    `min_replicas_ack`: replicas that must have a write before it is acknowledged (WAIT, up to
    `replica_ack_timeout_s`; fewer raise StoreUnavailableError). None means 1 on a cluster, whose
    failover promotes a replica, and 0 on one server.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        serializer: Serializer | None = None,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        retry: RetryPolicy | None = None,
        socket_timeout_s: float = 5.0,
        min_replicas_ack: int | None = None,
        replica_ack_timeout_s: float = 1.0,
    ) -> None:
        from redis import exceptions as rexc

        if min_replicas_ack is None:
            min_replicas_ack = 1 if is_cluster_url(url) else 0
        if min_replicas_ack and replica_ack_timeout_s >= socket_timeout_s:
            raise InvalidStoreRequest("replica_ack_timeout_s must be below socket_timeout_s")
        self.url = url
        self.serializer: Serializer = serializer or JsonSerializer()
        self.piece_bytes = piece_bytes
        self.retry = retry or RetryPolicy()
        self.min_replicas_ack = min_replicas_ack
        self.replica_ack_timeout_s = replica_ack_timeout_s
        self._redis = RedisConnections(url, socket_timeout_s=socket_timeout_s)
        self._client: Any = self._redis.client
        self._transient = self._redis.transient_errors()
        self._redis_error = rexc.RedisError

    async def _do(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await retrying(call, self.retry, self._transient, f"redis {what}")
        except StoreError:
            raise
        except self._redis_error as e:
            raise StoreError(f"redis {what} failed: {e}") from e

    async def _write(self, slot_key: str, *commands: tuple[Any, ...]) -> list[Any]:
        """Run `commands` in order on one connection to the primary of `slot_key`'s slot, then
        WAIT for `min_replicas_ack` replicas (it counts the writes of its own connection)."""
        try:
            primary = await self._redis.primary(slot_key)
            pipe = primary.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            if self.min_replicas_ack:
                timeout_ms = int(self.replica_ack_timeout_s * 1000)
                pipe.execute_command("WAIT", self.min_replicas_ack, timeout_ms)
            results: list[Any] = await pipe.execute()
        except self._transient:
            self._redis.write_failed()
            raise
        if self.min_replicas_ack:
            acked = int(results.pop())
            if acked < self.min_replicas_ack:
                raise StoreUnavailableError(
                    f"redis write reached {acked} of {self.min_replicas_ack} replicas in "
                    f"{self.replica_ack_timeout_s} s (min_replicas_ack; 0 on a cluster without "
                    "replicas)"
                )
        return results

    # Interface --------------------------------------------------------------------------------

    async def put_blob(self, key: Key, data: bytes) -> None:
        data = bytes(data)
        header_key = redis_key(key.tag, "blob", key.path)
        index_key = redis_key(key.tag, "index", "")
        version = uuid.uuid4().hex[:16]
        n = max(1, -(-len(data) // self.piece_bytes))
        pieces = [redis_key(key.tag, "piece", f"{key.path}:{version}:{i}") for i in range(n)]
        chunks = [data[i * self.piece_bytes : (i + 1) * self.piece_bytes] for i in range(n)]

        async def write() -> None:
            [old] = await self._write(
                header_key,
                ("EVAL", _PUBLISH_BLOB, 2 + n, header_key, index_key, *pieces,
                 version, n, len(data), f"blob:{key.path}", *chunks),
            )  # fmt: skip
            replaced = _header(old)
            if replaced and replaced["version"] != version:
                await self._drop_pieces(key, replaced)

        await self._do("put_blob", write)

    def _piece_keys(self, key: Key, header: Mapping[str, str]) -> list[str]:
        version = header["version"]
        return [
            redis_key(key.tag, "piece", f"{key.path}:{version}:{i}")
            for i in range(int(header["pieces"]))
        ]

    async def _drop_pieces(self, key: Key, header: Mapping[str, str]) -> None:
        await self._client.delete(*self._piece_keys(key, header))

    async def get_blob(self, key: Key) -> bytes:
        header_key = redis_key(key.tag, "blob", key.path)

        async def read() -> bytes:
            for _ in range(3):  # a concurrent overwrite may drop the pieces we are reading
                header = _header(await self._client.hgetall(header_key))
                if not header:
                    raise NotFound(f"no blob under {key.tag}/{key.path}")
                pieces = await self._client.mget(self._piece_keys(key, header))
                if all(p is not None for p in pieces):
                    blob = b"".join(_bytes(p) for p in pieces)
                    if len(blob) != int(header["size"]):
                        raise StoreError(f"blob {key.tag}/{key.path} has the wrong size")
                    return blob
            raise Conflict(f"blob {key.tag}/{key.path} kept changing while being read")

        return await self._do("get_blob", read)

    async def has_blob(self, key: Key) -> bool:
        header_key = redis_key(key.tag, "blob", key.path)
        return bool(await self._do("has_blob", lambda: self._client.exists(header_key)))

    async def put_record(
        self, key: Key, record: Mapping[str, Any], *, if_absent: bool = False
    ) -> None:
        data = self.serializer.dumps(record)
        rec_key = redis_key(key.tag, "rec", key.path)
        index_key = redis_key(key.tag, "index", "")

        async def write() -> None:
            [written] = await self._write(
                rec_key,
                ("EVAL", _PUT_RECORD, 2, rec_key, index_key,
                 data, "1" if if_absent else "0", f"rec:{key.path}"),
            )  # fmt: skip
            if not written:
                raise Conflict(f"record {key.tag}/{key.path} already exists")

        await self._do("put_record", write)

    async def get_record(self, key: Key) -> dict[str, Any]:
        rec_key = redis_key(key.tag, "rec", key.path)
        data = await self._do("get_record", lambda: self._client.get(rec_key))
        if data is None:
            raise NotFound(f"no record under {key.tag}/{key.path}")
        return self.serializer.loads(_bytes(data))

    async def delete(self, key: Key) -> bool:
        header_key = redis_key(key.tag, "blob", key.path)
        rec_key = redis_key(key.tag, "rec", key.path)
        index_key = redis_key(key.tag, "index", "")

        async def remove() -> bool:
            header = _header(await self._client.hgetall(header_key))
            pieces = self._piece_keys(key, header) if header else []
            removed, _ = await self._write(
                header_key,
                ("DEL", header_key, rec_key, *pieces),
                ("SREM", index_key, f"blob:{key.path}", f"rec:{key.path}"),
            )
            return bool(removed)

        return await self._do("delete", remove)

    async def list_paths(self, tag: str, prefix: str = "") -> list[str]:
        index_key = redis_key(tag, "index", "")
        members = await self._do("list", lambda: self._client.smembers(index_key))
        paths = {_bytes(m).decode().split(":", 1)[1] for m in members}
        return sorted(p for p in paths if p.startswith(prefix))

    async def delete_tag(self, tag: str) -> int:
        index_key = redis_key(tag, "index", "")

        async def remove() -> int:
            members = await self._client.smembers(index_key)
            deletes: list[tuple[Any, ...]] = []  # one per indexed value, counted
            pieces: list[str] = []
            for m in members:
                kind, path = _bytes(m).decode().split(":", 1)
                if kind == "blob":
                    header_key = redis_key(tag, "blob", path)
                    header = _header(await self._client.hgetall(header_key))
                    pieces += self._piece_keys(Key(tag, path), header) if header else []
                    deletes.append(("DEL", header_key))
                else:
                    deletes.append(("DEL", redis_key(tag, "rec", path)))
            results = await self._write(index_key, *deletes, ("DEL", index_key, *pieces))
            return sum(int(r) for r in results[: len(deletes)])

        return await self._do("delete_tag", remove)

    async def ping(self) -> None:
        await self._do("ping", self._redis.ping)

    async def close(self) -> None:
        await self._redis.close()

    # For other modules' atomic steps (memory_store/usage.py) -----------------------------------

    async def run_script(self, what: str, script: str, keys: list[str], args: list[Any]) -> Any:
        """Run a Lua `script` on the primary of `keys[0]`'s slot (every key in one hash tag),
        acknowledged as every write is (WAIT), retried as every call is."""

        async def run() -> Any:
            [result] = await self._write(keys[0], ("EVAL", script, len(keys), *keys, *args))
            return result

        return await self._do(what, run)
