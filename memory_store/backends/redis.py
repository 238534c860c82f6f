"""The Redis backend: keys `longserve:{<tag>}:<kind>:<path>`, so Redis Cluster keeps a whole
session (`{sess:ID}`), collection (`{coll:NAME}`) or chunk in one slot.

Blobs are split into pieces of a few MB written under a fresh version and published by swapping
a small header, so a reader never sees half of a blob. Transient connection failures are retried
with backoff (`memory_store.retry`).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from memory_store.backends.base import Backend, JsonSerializer, Serializer
from memory_store.errors import Conflict, NotFound, StoreError
from memory_store.keys import Key, redis_key
from memory_store.retry import RetryPolicy, retrying

T = TypeVar("T")

DEFAULT_PIECE_BYTES = 4 * 1024 * 1024


def _bytes(value: bytes | str | None) -> bytes:
    if value is None:
        raise StoreError("redis returned nothing where a value was expected")
    return value.encode() if isinstance(value, str) else value


def _header(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {_bytes(k).decode(): _bytes(v).decode() for k, v in raw.items()}


class RedisBackend(Backend):
    """redis.asyncio over one URL. Blobs in pieces of `piece_bytes`, published atomically.

    Layout, all under the key's hash tag:
      `longserve:{T}:blob:P`        header hash {version, pieces, size}
      `longserve:{T}:piece:P:V:i`   piece i of version V
      `longserve:{T}:rec:P`         serialized record
      `longserve:{T}:index`         set of "blob:P" / "rec:P" (listing without SCAN)
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
    ) -> None:
        import redis.asyncio as aioredis
        from redis import exceptions as rexc

        self.url = url
        self.serializer: Serializer = serializer or JsonSerializer()
        self.piece_bytes = piece_bytes
        self.retry = retry or RetryPolicy()
        self._client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            retry_on_timeout=False,
        )
        self._transient: tuple[type[BaseException], ...] = (
            rexc.ConnectionError,
            rexc.TimeoutError,
            rexc.BusyLoadingError,
            ConnectionError,
            TimeoutError,
        )
        self._redis_error = rexc.RedisError

    async def _do(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await retrying(call, self.retry, self._transient, f"redis {what}")
        except StoreError:
            raise
        except self._redis_error as e:
            raise StoreError(f"redis {what} failed: {e}") from e

    # Interface --------------------------------------------------------------------------------

    async def put_blob(self, key: Key, data: bytes) -> None:
        data = bytes(data)
        header_key = redis_key(key.tag, "blob", key.path)
        index_key = redis_key(key.tag, "index", "")
        version = uuid.uuid4().hex[:16]
        n = max(1, -(-len(data) // self.piece_bytes))

        async def write() -> None:
            # One MULTI (one slot): the new pieces, then the header swap, reading the old header
            # inside the transaction so that concurrent writers each drop exactly what they
            # replaced. Readers see the old blob or the new one, never a mix.
            pipe = self._client.pipeline(transaction=True)
            for i in range(n):
                piece = data[i * self.piece_bytes : (i + 1) * self.piece_bytes]
                pipe.set(redis_key(key.tag, "piece", f"{key.path}:{version}:{i}"), piece)
            pipe.hgetall(header_key)
            pipe.delete(header_key)
            pipe.hset(header_key, mapping={"version": version, "pieces": n, "size": len(data)})
            pipe.sadd(index_key, f"blob:{key.path}")
            results = await pipe.execute()
            old = _header(results[n])
            if old and old["version"] != version:
                await self._drop_pieces(key, old)

        await self._do("put_blob", write)

    async def _drop_pieces(self, key: Key, header: Mapping[str, str]) -> None:
        version = header["version"]
        n = int(header["pieces"])
        await self._client.delete(
            *(redis_key(key.tag, "piece", f"{key.path}:{version}:{i}") for i in range(n))
        )

    async def get_blob(self, key: Key) -> bytes:
        header_key = redis_key(key.tag, "blob", key.path)

        async def read() -> bytes:
            for _ in range(3):  # a concurrent overwrite may drop the pieces we are reading
                header = _header(await self._client.hgetall(header_key))
                if not header:
                    raise NotFound(f"no blob under {key.tag}/{key.path}")
                version = header["version"]
                n = int(header["pieces"])
                names = [redis_key(key.tag, "piece", f"{key.path}:{version}:{i}") for i in range(n)]
                pieces = await self._client.mget(names)
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
            ok = await self._client.set(rec_key, data, nx=if_absent)
            if not ok:
                raise Conflict(f"record {key.tag}/{key.path} already exists")
            await self._client.sadd(index_key, f"rec:{key.path}")

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
            if header:
                await self._drop_pieces(key, header)
            removed = await self._client.delete(header_key, rec_key)
            await self._client.srem(index_key, f"blob:{key.path}", f"rec:{key.path}")
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
            count = 0
            for m in members:
                kind, path = _bytes(m).decode().split(":", 1)
                if kind == "blob":
                    count += await self.delete(Key(tag, path))
                else:
                    count += await self._client.delete(redis_key(tag, "rec", path))
            await self._client.delete(index_key)
            return count

        return await self._do("delete_tag", remove)

    async def ping(self) -> None:
        await self._do("ping", self._client.ping)

    async def close(self) -> None:
        await self._client.aclose()
