"""docker-compose.yml, as `docker-compose config` renders it: the stack, its health checks and
start order, commands and secrets, scaling, and the gpu and cluster profiles."""

from __future__ import annotations

from typing import Any

from memory_store.settings import MemoryStoreSettings
from tests.deploy.compose_config import (
    CORE_SERVICES,
    PROFILED_SERVICES,
    REDIS_CLUSTER_NODES,
    SECRETS,
    compose_config,
)


def _depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def _healthcheck_text(service: dict[str, Any]) -> str:
    test = service.get("healthcheck", {}).get("test")
    assert test, "no healthcheck"
    return " ".join(test) if isinstance(test, list) else str(test)


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return command if isinstance(command, list) else command.split()


def test_compose_has_the_stack_with_health_checks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    # docker-compose 1.x renders profiled services too; Compose v2 leaves them out.
    assert CORE_SERVICES <= set(services) <= CORE_SERVICES | set(PROFILED_SERVICES)
    for name in CORE_SERVICES:
        assert not services[name].get("profiles"), f"{name} must start without a profile"
    for name in set(services) - CORE_SERVICES:
        assert services[name]["profiles"] == [PROFILED_SERVICES[name]], name
    for name in CORE_SERVICES:
        assert _healthcheck_text(services[name]), name
    for name in ("server", "memory-store"):
        assert "/health" in _healthcheck_text(services[name])
    assert "8000/health" in _healthcheck_text(services["server"])
    assert "8001/health" in _healthcheck_text(services["memory-store"])
    assert "redis-cli" in _healthcheck_text(services["redis"])


def test_compose_start_order_waits_for_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert _depends_on(services["server"]) == {"memory-store": "service_healthy"}
    assert _depends_on(services["memory-store"]) == {"redis": "service_healthy"}
    assert _depends_on(services["grafana"]) == {"prometheus": "service_healthy"}


def test_compose_commands_and_settings(compose: dict[str, Any]) -> None:
    services = compose["services"]
    server, store, redis = services["server"], services["memory-store"], services["redis"]

    assert _command(server) == [
        "longserve",
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--memory-store",
        "http://memory-store:8001",
    ]
    assert server["environment"]["LONGSERVE_API_KEYS"] == SECRETS["LONGSERVE_API_KEYS"]
    assert server["image"] == store["image"], "server and memory-store share one image"

    password = SECRETS["REDIS_PASSWORD"]
    assert _command(store)[:6] == [
        "longserve",
        "memory-store",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
    ]
    assert "--data-dir" not in _command(store), "the compose memory store runs on Redis"
    store_env = store["environment"]
    assert store_env["LONGSERVE_MEMORY_STORE_REDIS_URL"] == f"redis://:{password}@redis:6379/0"

    redis_command = " ".join(_command(redis))
    assert "--appendonly yes" in redis_command
    assert "--appendfsync everysec" in redis_command
    assert f"--requirepass {password}" in redis_command
    assert any(
        str(v).split(":")[0] == "redis-data"
        or (isinstance(v, dict) and v.get("source") == "redis-data")
        for v in redis["volumes"]
    )
    assert {"redis-data", "prometheus-data", "grafana-data"} <= set(compose["volumes"])


def test_compose_scales_without_host_port_conflicts(compose: dict[str, Any]) -> None:
    services = compose["services"]
    # Replicas of these are reached by service name; a fixed host port would break --scale.
    for name in ("server", "memory-store", "redis"):
        assert "ports" not in services[name], f"{name} must not publish a host port"
    for name in set(PROFILED_SERVICES) & set(services):
        assert "ports" not in services[name], f"{name} must not publish a host port"
    assert len(services["proxy"]["ports"]) == 1


def test_compose_refuses_to_start_without_secrets() -> None:
    for missing in SECRETS:
        result = compose_config({**SECRETS, missing: None})
        assert result.returncode != 0, f"config accepted a missing {missing}"
        assert f"set {missing}" in result.stderr + result.stdout


def test_compose_gpu_profile_reserves_a_gpu(compose_gpu: dict[str, Any]) -> None:
    services = compose_gpu["services"]
    assert CORE_SERVICES | {"server-gpu"} <= set(services) <= CORE_SERVICES | set(PROFILED_SERVICES)
    gpu = services["server-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["args"]["DEVICE"] == "cuda"
    assert gpu["image"] != services["server"]["image"]
    assert gpu["environment"]["LONGSERVE_DEVICE"] == "cuda"
    assert gpu["environment"]["LONGSERVE_API_KEYS"] == SECRETS["LONGSERVE_API_KEYS"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert _depends_on(gpu) == {"memory-store": "service_healthy"}
    assert "ports" not in gpu
    # Under the `server` name, the proxy and Prometheus find GPU replicas with the CPU ones.
    assert "server" in gpu["networks"]["default"]["aliases"]


def test_compose_cluster_profile_runs_the_memory_store_on_a_redis_cluster(
    compose_cluster: dict[str, Any],
) -> None:
    services = compose_cluster["services"]
    password = SECRETS["REDIS_PASSWORD"]
    assert {"memory-store-cluster", "redis-cluster-init", *REDIS_CLUSTER_NODES} <= set(services)

    volumes = set()
    for name in REDIS_CLUSTER_NODES:
        node = services[name]
        command = " ".join(_command(node))
        for option in ("--cluster-enabled yes", "--appendonly yes", "--appendfsync always",
                       f"--requirepass {password}", f"--masterauth {password}"):  # fmt: skip
            assert option in command, (name, option)
        assert node["environment"]["REDISCLI_AUTH"] == password
        assert "redis-cli" in _healthcheck_text(node)
        [volume] = node["volumes"]
        volumes.add(volume.split(":")[0] if isinstance(volume, str) else volume["source"])
    assert (
        volumes
        == {f"{name}-data" for name in REDIS_CLUSTER_NODES}
        <= set(compose_cluster["volumes"])
    )

    init = services["redis-cluster-init"]
    assert _depends_on(init) == dict.fromkeys(REDIS_CLUSTER_NODES, "service_healthy")
    assert init["environment"]["REDISCLI_AUTH"] == password
    assert init["environment"]["REDIS_CLUSTER_NODES"].split() == [
        f"{name}:6379" for name in REDIS_CLUSTER_NODES
    ]
    assert init["restart"] == "no"
    assert any("deploy/redis-cluster-init.sh" in str(v) for v in init["volumes"])

    store = services["memory-store-cluster"]
    assert store["image"] == services["server"]["image"]
    assert _command(store) == _command(services["memory-store"])
    assert _depends_on(store) == {"redis-cluster-init": "service_completed_successfully"}
    assert "memory-store" in store["networks"]["default"]["aliases"]  # what the servers call
    settings = MemoryStoreSettings(
        redis_url=store["environment"]["LONGSERVE_MEMORY_STORE_REDIS_URL"],
        redis_min_replicas_ack=store["environment"][
            "LONGSERVE_MEMORY_STORE_REDIS_MIN_REPLICAS_ACK"
        ],
    )
    assert settings.redis_url == (
        f"redis+cluster://:{password}@redis-node-1:6379,redis-node-2:6379,redis-node-3:6379"
    )
    assert settings.redis_min_replicas_ack == 1


def test_compose_authenticates_the_memory_store_and_caps_redis(
    compose: dict[str, Any], compose_gpu: dict[str, Any], compose_cluster: dict[str, Any]
) -> None:
    """Issue #41: servers and the memory service share LONGSERVE_MEMORY_STORE_TOKEN; every
    Redis runs with a maxmemory and noeviction (a full store is a 503, never a lost write)."""
    token = SECRETS["LONGSERVE_MEMORY_STORE_TOKEN"]
    services = {
        **compose["services"],
        **compose_gpu["services"],
        **compose_cluster["services"],
    }
    for name in ("server", "server-gpu", "memory-store", "memory-store-cluster"):
        assert services[name]["environment"]["LONGSERVE_MEMORY_STORE_TOKEN"] == token, name
    for name in ("redis", *REDIS_CLUSTER_NODES):
        command = " ".join(_command(services[name]))
        assert "--maxmemory 2gb" in command, name
        assert "--maxmemory-policy noeviction" in command, name
