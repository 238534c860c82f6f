"""The rendered docker-compose.yml, once per test module: plain, and with the gpu and cluster
profiles."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.compose_config import rendered


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return rendered()


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return rendered("--profile", "gpu")


@pytest.fixture(scope="module")
def compose_cluster() -> dict[str, Any]:
    return rendered("--profile", "cluster")
