"""Storage backends for the memory service: blobs and small records under structured keys.

A `Key` is a hash tag (everything that must live together: one session, one collection, one
content-addressed chunk) plus a path inside it. `KeySpace` is the one place that names keys;
each backend maps a `Key` to its own layout:

- `EmbeddedBackend(data_dir)`: one directory per tag, one file per key, written atomically
  (temporary file, fsync, `os.replace`, fsync of the directory).
- `RedisBackend(url)`: keys `longserve:{<tag>}:<kind>:<path>`, so Redis Cluster keeps a whole
  session (`{sess:ID}`), collection (`{coll:NAME}`) or chunk in one slot. Blobs are split into
  pieces of a few MB written under a fresh version and published by swapping a small header,
  so a reader never sees half of a blob.

Every failure surfaces as one exception tree (`StoreError`), raised `from` the cause.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import quote, unquote

from memory_store.errors import (
    Conflict,
    InvalidStoreRequest,
    NotFound,
    StoreError,
    StoreUnavailableError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Keys: the only place that names them.
# ---------------------------------------------------------------------------------------------

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_PATH_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


def validate_id(value: str, what: str) -> str:
    """Ids go into hash tags and file names: letters, digits, `._-`, at most 200 characters."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidStoreRequest(f"invalid {what} {value!r}: use letters, digits, '.', '_', '-'")
    return value


@dataclass(frozen=True, order=True)
class Key:
    """`tag` groups keys that must share a Redis Cluster slot; `path` names one value in it."""

    tag: str
    path: str

    def __post_init__(self) -> None:
        if "{" in self.tag or "}" in self.tag or not self.tag:
            raise InvalidStoreRequest(f"invalid key tag {self.tag!r}")
        if len(self.path) > 400 or not _PATH_RE.match(self.path):
            raise InvalidStoreRequest(f"invalid key path {self.path!r}")


class KeySpace:
    """Every key the memory service uses."""

    SESSION = "sess"
    COLLECTION = "coll"
    ENCODING = "enc"

    @staticmethod
    def session_tag(session_id: str) -> str:
        return f"{KeySpace.SESSION}:{validate_id(session_id, 'session id')}"

    @staticmethod
    def collection_tag(name: str) -> str:
        return f"{KeySpace.COLLECTION}:{validate_id(name, 'collection name')}"

    @staticmethod
    def chunk(fingerprint: str, chain_hash: str) -> Key:
        """One content-addressed chunk; shared by every session that holds the same tokens."""
        fp = validate_id(fingerprint, "model fingerprint")
        h = validate_id(chain_hash, "chain hash")
        return Key(f"{KeySpace.ENCODING}:{fp}:{h}", "chunk")

    @staticmethod
    def manifest(session_id: str, doc_id: str) -> Key:
        return Key(KeySpace.session_tag(session_id), f"doc/{validate_id(doc_id, 'document id')}")

    MANIFEST_PREFIX = "doc/"

    @staticmethod
    def larimar(session_id: str) -> Key:
        return Key(KeySpace.session_tag(session_id), "larimar")

    @staticmethod
    def collection_batch(name: str, batch_id: str) -> Key:
        return Key(KeySpace.collection_tag(name), f"batch/{validate_id(batch_id, 'batch id')}")

    COLLECTION_BATCH_PREFIX = "batch/"

    # Generic records and blobs (memory_store/records.py), grouped in namespaces. A namespace
    # is "<kind>:<id>" and IS a hash tag: "sess:ID" shares the tag of that session's manifests
    # and Larimar memory, so deleting the session deletes its records too.
    NAMESPACE_KINDS = (SESSION, "tenant")
    RECORD_PREFIX = "rec/"
    BLOB_PREFIX = "blob/"

    @staticmethod
    def namespace_tag(namespace: str) -> str:
        kind, sep, ident = namespace.partition(":") if isinstance(namespace, str) else ("", "", "")
        if not sep or kind not in KeySpace.NAMESPACE_KINDS:
            kinds = ", ".join(f"'{k}:ID'" for k in KeySpace.NAMESPACE_KINDS)
            raise InvalidStoreRequest(f"invalid namespace {namespace!r}: use one of {kinds}")
        return f"{kind}:{validate_id(ident, 'namespace id')}"

    @staticmethod
    def record(namespace: str, key: str) -> Key:
        tag = KeySpace.namespace_tag(namespace)
        return Key(tag, KeySpace.RECORD_PREFIX + validate_id(key, "record key"))

    @staticmethod
    def blob(namespace: str, key: str) -> Key:
        tag = KeySpace.namespace_tag(namespace)
        return Key(tag, KeySpace.BLOB_PREFIX + validate_id(key, "blob key"))


# ---------------------------------------------------------------------------------------------
# Serializer for records.
# ---------------------------------------------------------------------------------------------


class Serializer(Protocol):
    def dumps(self, obj: Mapping[str, Any]) -> bytes: ...

    def loads(self, data: bytes) -> dict[str, Any]: ...


class JsonSerializer:
    """Compact UTF-8 JSON. Records are small (manifests, headers); blobs never go through it."""

    def dumps(self, obj: Mapping[str, Any]) -> bytes:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def loads(self, data: bytes) -> dict[str, Any]:
        value = json.loads(data.decode("utf-8"))
        if not isinstance(value, dict):
            raise StoreError("stored record is not a JSON object")
        return value


# ---------------------------------------------------------------------------------------------
# The interface.
# ---------------------------------------------------------------------------------------------


class Backend(ABC):
    """Blobs (bytes of any size) and records (small JSON objects) under `Key`s. All async.

    A write returns only once the backend has accepted it durably as far as the backend goes
    (file fsynced and renamed; Redis command answered, AOF fsync policy being Redis's own).
    Blobs and records live in separate namespaces: the same key may hold one of each.
    """

    name: str = "backend"

    @abstractmethod
    async def put_blob(self, key: Key, data: bytes) -> None: ...

    @abstractmethod
    async def get_blob(self, key: Key) -> bytes:
        """Raises NotFound."""

    @abstractmethod
    async def has_blob(self, key: Key) -> bool: ...

    @abstractmethod
    async def put_record(
        self, key: Key, record: Mapping[str, Any], *, if_absent: bool = False
    ) -> None:
        """Raises Conflict when `if_absent` and a record is already there."""

    @abstractmethod
    async def get_record(self, key: Key) -> dict[str, Any]:
        """Raises NotFound."""

    @abstractmethod
    async def delete(self, key: Key) -> bool:
        """Delete the blob and the record under `key`; True if anything was there."""

    @abstractmethod
    async def list_paths(self, tag: str, prefix: str = "") -> list[str]:
        """Sorted paths under `tag` (blob or record) that start with `prefix`."""

    @abstractmethod
    async def delete_tag(self, tag: str) -> int:
        """Delete everything under `tag`; returns how many keys went."""

    @abstractmethod
    async def ping(self) -> None:
        """Raises StoreUnavailableError when the backend cannot be reached."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


# ---------------------------------------------------------------------------------------------
# Embedded: files in a data directory.
# ---------------------------------------------------------------------------------------------

_TMP_MARK = ".tmp-"


class EmbeddedBackend(Backend):
    """Files under `data_dir/<tag>/<path>.{blob,rec}`, written atomically.

    Blocking file I/O runs in worker threads. A crash mid-write leaves at most a stray
    `.tmp-*` file, which listings ignore and `put_*` of the same key cleans up on the next write.
    """

    name = "embedded"

    def __init__(self, data_dir: str | os.PathLike[str], serializer: Serializer | None = None):
        self.root = Path(data_dir)
        self.serializer: Serializer = serializer or JsonSerializer()
        self.root.mkdir(parents=True, exist_ok=True)

    # Layout -----------------------------------------------------------------------------------

    def _dir(self, tag: str) -> Path:
        name = quote(tag, safe="")
        if len(name) > 200:  # keep under NAME_MAX (255) whatever the fingerprint's length
            name = f"{name[:120]}~{hashlib.sha256(tag.encode()).hexdigest()}"
        return self.root / name

    def _file(self, key: Key, kind: str) -> Path:
        return self._dir(key.tag) / f"{quote(key.path, safe='')}.{kind}"

    # Plumbing ---------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreError:
            raise
        except FileNotFoundError as e:
            raise NotFound(str(e)) from e
        except OSError as e:
            raise StoreUnavailableError(f"embedded store I/O failed: {e}") from e

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}-{path.name}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _read(path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    # Interface --------------------------------------------------------------------------------

    async def put_blob(self, key: Key, data: bytes) -> None:
        await self._run(self._write_atomic, self._file(key, "blob"), bytes(data))

    async def get_blob(self, key: Key) -> bytes:
        try:
            return await self._run(self._read, self._file(key, "blob"))
        except NotFound as e:
            raise NotFound(f"no blob under {key.tag}/{key.path}") from e

    async def has_blob(self, key: Key) -> bool:
        return await self._run(self._file(key, "blob").is_file)

    async def put_record(
        self, key: Key, record: Mapping[str, Any], *, if_absent: bool = False
    ) -> None:
        data = self.serializer.dumps(record)
        path = self._file(key, "rec")

        def write() -> None:
            if if_absent:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}-{path.name}")
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError as e:
                    raise Conflict(f"record {key.tag}/{key.path} already exists") from e
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                self._write_atomic(path, data)

        await self._run(write)

    async def get_record(self, key: Key) -> dict[str, Any]:
        try:
            data = await self._run(self._read, self._file(key, "rec"))
        except NotFound as e:
            raise NotFound(f"no record under {key.tag}/{key.path}") from e
        return self.serializer.loads(data)

    async def delete(self, key: Key) -> bool:
        def remove() -> bool:
            found = False
            for kind in ("blob", "rec"):
                try:
                    self._file(key, kind).unlink()
                    found = True
                except FileNotFoundError:
                    pass
            return found

        return await self._run(remove)

    async def list_paths(self, tag: str, prefix: str = "") -> list[str]:
        def scan() -> list[str]:
            directory = self._dir(tag)
            if not directory.is_dir():
                return []
            paths = set()
            for entry in os.listdir(directory):
                if entry.startswith(_TMP_MARK):
                    continue
                stem, _, kind = entry.rpartition(".")
                if kind in ("blob", "rec"):
                    path = unquote(stem)
                    if path.startswith(prefix):
                        paths.add(path)
            return sorted(paths)

        return await self._run(scan)

    async def delete_tag(self, tag: str) -> int:
        def remove() -> int:
            directory = self._dir(tag)
            if not directory.is_dir():
                return 0
            count = sum(1 for e in os.listdir(directory) if not e.startswith(_TMP_MARK))
            # Rename first so a concurrent reader sees all or nothing of the tag.
            doomed = directory.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}")
            os.replace(directory, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            return count

        return await self._run(remove)

    async def ping(self) -> None:
        def check() -> None:
            if not os.access(self.root, os.W_OK):
                raise StoreUnavailableError(f"data directory {self.root} is not writable")

        await self._run(check)


# ---------------------------------------------------------------------------------------------
# Redis.
# ---------------------------------------------------------------------------------------------

REDIS_KEY_PREFIX = "longserve"
DEFAULT_PIECE_BYTES = 4 * 1024 * 1024


def redis_key(key_tag: str, kind: str, path: str) -> str:
    """`longserve:{sess:ID}:blob:doc/x` - the hash tag is the part in braces."""
    return f"{REDIS_KEY_PREFIX}:{{{key_tag}}}:{kind}:{path}"


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff for transient connection failures."""

    attempts: int = 4
    base_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def delay(self, attempt: int) -> float:
        return float(min(self.max_delay_s, self.base_delay_s * (2**attempt)))


async def retrying(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    transient: tuple[type[BaseException], ...],
    what: str,
) -> T:
    """Run `call`, retrying `transient` errors; after the last attempt raise StoreUnavailableError."""
    for attempt in range(policy.attempts):
        try:
            return await call()
        except transient as e:
            if attempt + 1 >= policy.attempts:
                raise StoreUnavailableError(
                    f"{what}: unreachable after {policy.attempts} tries: {e}"
                ) from e
            logger.debug("%s failed (%s); retry %d", what, e, attempt + 1)
            await asyncio.sleep(policy.delay(attempt))
    raise AssertionError("unreachable")


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


def build_backend(
    *,
    redis_url: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    retry: RetryPolicy | None = None,
) -> Backend:
    """Exactly one of `redis_url` / `data_dir`."""
    if (redis_url is None) == (data_dir is None):
        raise InvalidStoreRequest("give exactly one of redis_url and data_dir")
    if redis_url is not None:
        return RedisBackend(redis_url, piece_bytes=piece_bytes, retry=retry)
    assert data_dir is not None
    return EmbeddedBackend(data_dir)
