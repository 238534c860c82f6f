"""`docker-compose config` over the repository's docker-compose.yml, with test secrets and an
empty env file, so that only what the test sets reaches the rendering."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import REPO, tool, yaml_module

SECRETS = {
    "LONGSERVE_API_KEYS": "test-key-1,test-key-2",
    "REDIS_PASSWORD": "test-redis-password",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana-password",
    "LONGSERVE_MEMORY_STORE_TOKEN": "test-memory-store-token",
}
CORE_SERVICES = {"proxy", "server", "memory-store", "redis", "prometheus", "grafana"}
REDIS_CLUSTER_NODES = [f"redis-node-{i}" for i in range(1, 7)]
PROFILED_SERVICES = {  # service -> the profile that starts it
    "server-gpu": "gpu",
    "memory-store-cluster": "cluster",
    "redis-cluster-init": "cluster",
    **dict.fromkeys(REDIS_CLUSTER_NODES, "cluster"),
}


def compose_command() -> list[str]:
    compose = tool("docker-compose")
    if compose:
        return [compose]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return [docker, "compose"]
    pytest.skip(
        "neither `docker-compose` nor `docker compose` is installed "
        "(apt-get install docker-compose)"
    )


def compose_config(
    env_overrides: dict[str, str | None],
    *args: str,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and k != "COMPOSE_PROFILES"}
    env.update({k: v for k, v in env_overrides.items() if v is not None})
    # An empty env file, so that a developer's .env cannot fill in what the test leaves unset.
    command = compose_command()
    with tempfile.TemporaryDirectory() as tmp:
        empty_env_file = Path(tmp) / "empty.env"
        empty_env_file.touch()
        return subprocess.run(
            [
                *command,
                "--project-directory",
                str(REPO),
                "--env-file",
                str(empty_env_file),
                "-f",
                str(REPO / "docker-compose.yml"),
                *args,
                "config",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=60,
            check=False,
        )


def rendered(*args: str) -> dict[str, Any]:
    yaml = yaml_module()
    result = compose_config(dict(SECRETS), *args)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)
