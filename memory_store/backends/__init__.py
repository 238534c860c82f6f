"""Storage backends for the memory service: blobs and small records under structured keys.

- `EmbeddedBackend(data_dir)` (`embedded.py`): one directory per tag, one file per key, written
  atomically.
- `RedisBackend(url)` (`redis.py`): one Redis hash tag per tag, blobs in pieces published
  atomically; on one server or a Redis Cluster (`redis+cluster://`, `redis_connections.py`).

`Backend` and the record `Serializer` are in `base.py`; keys in `memory_store.keys`; retries in
`memory_store.retry`. Names from those modules are re-exported here for older import paths.
"""

from __future__ import annotations

import os

from memory_store.backends.base import Backend, JsonSerializer, Serializer
from memory_store.backends.embedded import EmbeddedBackend
from memory_store.backends.redis import DEFAULT_PIECE_BYTES, RedisBackend
from memory_store.errors import InvalidStoreRequest
from memory_store.keys import REDIS_KEY_PREFIX, Key, KeySpace, redis_key, validate_id
from memory_store.retry import RetryPolicy, retrying

__all__ = [
    "DEFAULT_PIECE_BYTES",
    "REDIS_KEY_PREFIX",
    "Backend",
    "EmbeddedBackend",
    "JsonSerializer",
    "Key",
    "KeySpace",
    "RedisBackend",
    "RetryPolicy",
    "Serializer",
    "build_backend",
    "redis_key",
    "retrying",
    "validate_id",
]


def build_backend(
    *,
    redis_url: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    retry: RetryPolicy | None = None,
    min_replicas_ack: int | None = None,
    replica_ack_timeout_s: float = 1.0,
) -> Backend:
    """Exactly one of `redis_url` / `data_dir`; the other arguments are for Redis."""
    if (redis_url is None) == (data_dir is None):
        raise InvalidStoreRequest("give exactly one of redis_url and data_dir")
    if redis_url is not None:
        return RedisBackend(
            redis_url,
            piece_bytes=piece_bytes,
            retry=retry,
            min_replicas_ack=min_replicas_ack,
            replica_ack_timeout_s=replica_ack_timeout_s,
        )
    assert data_dir is not None
    return EmbeddedBackend(data_dir)
