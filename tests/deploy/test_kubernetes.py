"""deploy/k8s: the kustomize base and every overlay, rendered by real kustomize, pass the
Kubernetes schemas (kubernetes-validate, strict: no unknown field), for the oldest Kubernetes
they need and the newest the schemas know. The custom resources those schemas lack
(ServiceMonitor; the example's InferencePool and HTTPRoute) are checked field by field here.
Then what no schema sees: selectors, ports and probes against the code's routes, secret keys,
environment variables against the settings that read them, and the proxy's config against
deploy/nginx.conf. Nothing here runs on a cluster."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from memory_store.settings import MemoryStoreSettings
from server.routes.health import router as health_router
from server.settings import ServerSettings
from tests.deploy.kustomize_render import (
    K8S,
    RENDERED,
    WORKLOADS,
    container,
    containers,
    env,
    find,
    load_yaml,
    of_kind,
    pod_labels,
    render_all,
    secrets_example,
    selects,
)
from tests.deploy.tools import DEPLOY, REPO, nginx_check, require

# The preStop `sleep` action is on by default from 1.30.
KUBERNETES_VERSIONS = ("1.30", "latest")
CUSTOM_KINDS = {"ServiceMonitor", "InferencePool", "HTTPRoute"}
NAMESPACE = "longserve"
SERVER_PORT = 8000
MEMORY_STORE_PORT = 8001
# Set only to be spelled into another value of the same container as $(NAME), or read by a
# third-party program.
THIRD_PARTY_ENV = {"redis": {"REDISCLI_AUTH"}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return render_all(tmp_path_factory.mktemp("kustomize"))


@pytest.mark.parametrize("overlay", RENDERED)
def test_every_document_passes_the_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the dev extra has it)"
    )
    versions = [
        kubernetes_validate.latest_version() if v == "latest" else v for v in KUBERNETES_VERSIONS
    ]
    checked = 0
    for document in rendered[overlay]:
        if document["kind"] in CUSTOM_KINDS:
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                name = f"{document['kind']}/{document['metadata']['name']}"
                path = "/".join(str(p) for p in e.path)
                pytest.fail(f"{overlay}: {name} at {path} (Kubernetes {version}): {e.message}")
        checked += 1
    assert checked >= 9, f"{overlay} rendered {checked} documents"


@pytest.mark.parametrize("overlay", RENDERED)
def test_everything_lands_in_the_namespace(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    for document in rendered[overlay]:
        if document["kind"] == "Namespace":
            assert document["metadata"]["name"] == NAMESPACE
        else:
            where = document["metadata"].get("namespace")
            assert where == NAMESPACE, (document["kind"], document["metadata"]["name"], where)


@pytest.mark.parametrize("overlay", RENDERED)
def test_services_select_pods_and_name_their_ports(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    documents = rendered[overlay]
    workloads = of_kind(documents, *WORKLOADS)
    for service in of_kind(documents, "Service"):
        selector = service["spec"]["selector"]
        (workload,) = [w for w in workloads if selects(selector, pod_labels(w))]
        container_ports = {
            port[key] for c in containers(workload) for port in c["ports"] for key in port
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports, (service["metadata"]["name"], port)
    for workload in workloads:
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selects(selector, pod_labels(workload)), workload["metadata"]["name"]


def test_probes_hit_the_routes_the_code_serves(rendered: dict[str, list[dict[str, Any]]]) -> None:
    documents = rendered["overlays/cpu"]
    server_routes = {route.path for route in health_router.routes}
    memory_store_routes = set(
        re.findall(r'@app\.get\("(/\w+)"\)', (REPO / "memory_store" / "app.py").read_text())
    )
    nginx_locations = set(
        re.findall(r"location = (/[\w-]+)", (K8S / "base" / "nginx.conf").read_text())
    )
    expected = {  # container: (its routes, port, readiness path, liveness and startup path)
        "server": (server_routes, SERVER_PORT, "/ready", "/health"),
        "memory-store": (memory_store_routes, MEMORY_STORE_PORT, "/ready", "/health"),
        "nginx": (nginx_locations, SERVER_PORT, "/proxy-health", "/proxy-health"),
    }
    for workload in of_kind(documents, "Deployment"):
        for spec in containers(workload):
            routes, port, ready, alive = expected[spec["name"]]
            ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
            assert set(ports.values()) == {port}, spec["name"]
            for probe, path in (
                ("readinessProbe", ready),
                ("livenessProbe", alive),
                ("startupProbe", alive),
            ):
                if probe not in spec:
                    assert probe == "startupProbe" and spec["name"] == "nginx"
                    continue
                get = spec[probe]["httpGet"]
                assert get["path"] == path and path in routes, (spec["name"], probe, routes)
                assert ports.get(get["port"], get["port"]) == port, (spec["name"], probe)
    server = container(find(documents, "Deployment", "longserve-server"), "server")
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model load time"


@pytest.mark.parametrize("overlay", RENDERED)
def test_secret_refs_name_keys_of_the_secret(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    documents = rendered[overlay]
    secret = find(documents, "Secret")
    assert set(secret["data"]) == set(secrets_example())
    for value in secrets_example().values():
        assert "REPLACE-ME" in value, "the committed example holds placeholders only"
    refs = 0
    for workload in of_kind(documents, *WORKLOADS):
        for spec in containers(workload):
            for entry in spec.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"], entry
                    assert ref["key"] in secret["data"], entry
                    refs += 1
    assert refs >= 4


@pytest.mark.parametrize("overlay", RENDERED)
def test_environment_names_are_read_by_the_settings(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    read = {
        "server": {f"LONGSERVE_{name.upper()}" for name in ServerSettings.model_fields},
        "memory-store": {
            f"LONGSERVE_MEMORY_STORE_{name.upper()}" for name in MemoryStoreSettings.model_fields
        },
    }
    for workload in of_kind(rendered[overlay], *WORKLOADS):
        for spec in containers(workload):
            spelled = " ".join(
                [*spec.get("command", []), *(e.get("value", "") for e in spec.get("env", []))]
            )
            for name in env(spec):
                if name in read.get(spec["name"], set()):
                    continue
                assert (
                    name in THIRD_PARTY_ENV.get(spec["name"], set()) or f"$({name})" in spelled
                ), f"{spec['name']} sets {name}, which nothing reads"


def test_overlays_pick_the_device_and_the_store(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, image, device in (
        ("overlays/cpu", "longserve:cpu", "cpu"),
        ("overlays/gpu", "longserve:cuda", "cuda"),
    ):
        server = container(find(rendered[overlay], "Deployment", "longserve-server"), "server")
        assert server["image"] == image
        assert env(server)["LONGSERVE_DEVICE"]["value"] == device
        gpus = server["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (1 if device == "cuda" else None)
        memory_store = find(rendered[overlay], "Deployment", "longserve-memory-store")
        assert container(memory_store, "memory-store")["image"] == "longserve:cpu"
        assert len(of_kind(rendered[overlay], "ServiceMonitor")) == 2

    external = rendered["overlays/cpu-external-redis"]
    assert not of_kind(external, "StatefulSet")
    assert "longserve-redis" not in {s["metadata"]["name"] for s in of_kind(external, "Service")}
    memory_store = container(find(external, "Deployment", "longserve-memory-store"), "memory-store")
    url = env(memory_store)["LONGSERVE_MEMORY_STORE_REDIS_URL"]
    assert url["valueFrom"]["secretKeyRef"]["key"] == "redis-url" and "value" not in url


def test_redis_keeps_acknowledged_data(rendered: dict[str, list[dict[str, Any]]]) -> None:
    documents = rendered["overlays/cpu"]
    redis = find(documents, "StatefulSet", "longserve-redis")
    command = " ".join(container(redis, "redis")["command"])
    for flag in (
        "--appendonly yes",
        "--maxmemory-policy noeviction",
        "--requirepass $(REDIS_PASSWORD)",
    ):
        assert flag in command
    maxmemory = re.search(r"--maxmemory (\d+)gb", command)
    limit = container(redis, "redis")["resources"]["limits"]["memory"]
    assert maxmemory and int(limit.removesuffix("Gi")) > int(maxmemory.group(1)), "room to fork"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(redis, "redis")["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    memory_store = container(
        find(documents, "Deployment", "longserve-memory-store"), "memory-store"
    )
    url = env(memory_store)["LONGSERVE_MEMORY_STORE_REDIS_URL"]["value"]
    assert url == f"redis://:$(REDIS_PASSWORD)@{redis['spec']['serviceName']}:6379/0"


def test_pods_run_as_the_images_non_root_users(rendered: dict[str, list[dict[str, Any]]]) -> None:
    uid = re.search(r"useradd --system --uid (\d+)", (REPO / "Dockerfile").read_text())
    assert uid
    for workload in of_kind(rendered["overlays/gpu"], *WORKLOADS):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for spec in containers(workload):
            if spec["image"].startswith("longserve:"):
                assert pod["securityContext"]["runAsUser"] == int(uid.group(1))
            assert spec["securityContext"]["allowPrivilegeEscalation"] is False
            assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_service_monitors_scrape_the_servers_and_the_memory_service(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    documents = rendered[overlay]
    scraped = set()
    for monitor in of_kind(documents, "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == NAMESPACE
        (service,) = [
            s
            for s in of_kind(documents, "Service")
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
        scraped.add(service["metadata"]["name"])
    assert scraped == {"longserve-server", "longserve-memory-store"}


def without_discovery(text: str) -> list[str]:
    """nginx.conf's directives, but for the resolver and the upstream block, comments dropped."""
    text = re.sub(r"#[^\n]*", "", text)
    text = re.sub(r"upstream \w+ \{.*?\}", "", text, flags=re.S)
    text = re.sub(r"resolver [^;]*;", "", text)
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_proxy_config_is_the_compose_one_but_for_discovery(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    ours = (K8S / "base" / "nginx.conf").read_text()
    assert without_discovery(ours) == without_discovery((DEPLOY / "nginx.conf").read_text())
    assert re.search(r"resolver kube-dns\.kube-system\.svc\.cluster\.local valid=\d+s", ours)
    upstream = re.search(r"upstream (\w+) \{(.*?)\}", ours, re.S)
    assert upstream and f"proxy_pass http://{upstream.group(1)};" in ours
    assert re.search(r"^\s*hash \$longserve_affinity_key consistent;", upstream.group(2), re.M)
    assert re.search(r"^\s*zone \w+ \d+k;", upstream.group(2), re.M)
    server = re.search(r"server ([\w.-]+) service=(\w+) resolve weight=\d+;", upstream.group(2))
    assert server, upstream.group(2)

    documents = rendered["overlays/cpu"]
    headless = find(documents, "Service", "longserve-server")
    assert headless["spec"]["clusterIP"] == "None", "DNS must list every pod"
    service, namespace = headless["metadata"]["name"], headless["metadata"]["namespace"]
    assert server.group(1) == f"{service}.{namespace}.svc.cluster.local"
    assert server.group(2) in {p["name"] for p in headless["spec"]["ports"]}, "the SRV records"
    servers = find(documents, "Deployment", "longserve-server")
    assert selects(headless["spec"]["selector"], pod_labels(servers))

    proxy = find(documents, "Deployment", "longserve-proxy")
    command = container(proxy, "nginx")["command"]
    config_path = Path(command[command.index("-c") + 1])
    (mount,) = [m for m in container(proxy, "nginx")["volumeMounts"] if m["name"] == "config"]
    assert config_path.parent == Path(mount["mountPath"])
    (volume,) = [v for v in proxy["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    config_map = find(documents, "ConfigMap", volume["configMap"]["name"])
    assert config_map["data"][config_path.name] == ours


def test_proxy_config_passes_nginx_check(tmp_path: Path) -> None:
    nginx = require("nginx", Path("/usr/sbin/nginx"), install="apt-get install nginx-light")
    text = (K8S / "base" / "nginx.conf").read_text()
    # The local nginx may predate `resolve` and `service=` (1.27.3), and neither kube-dns nor the
    # Service exists here: check a copy naming addresses, all else unchanged.
    text = re.sub(r"server [\w.-]+ service=\w+ resolve weight=\d+;", "server 127.0.0.1:8000;", text)
    text = re.sub(r"resolver [\w.-]+ ", "resolver 127.0.0.1 ", text)
    result = nginx_check(nginx, text, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_inference_pool_example_selects_the_server_pods() -> None:
    base = load_yaml(K8S / "base" / "server.yaml")
    servers = find(base, "Deployment", "longserve-server")
    proxy_service = find(load_yaml(K8S / "base" / "proxy.yaml"), "Service")
    example = load_yaml(K8S / "examples" / "inference-pool.yaml")

    pool = find(example, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == NAMESPACE
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == servers["spec"]["selector"]["matchLabels"]
    assert selects(spec["selector"]["matchLabels"], pod_labels(servers))
    assert spec["targetPorts"] == [{"number": SERVER_PORT}]
    assert {p["containerPort"] for p in container(servers, "server")["ports"]} == {SERVER_PORT}
    picker = spec["endpointPickerRef"]
    assert picker["name"] and 1 <= picker["port"]["number"] <= 65535
    assert picker.get("failureMode", "FailClose") in {"FailOpen", "FailClose"}
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}

    route = find(example, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["namespace"] == NAMESPACE
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"
    backends = {}
    for rule in route["spec"]["rules"]:
        (backend,) = rule["backendRefs"]
        with_header = any("headers" in match for match in rule["matches"])
        backends[backend["kind"], with_header] = backend
    pool_ref = backends["InferencePool", False]
    assert (pool_ref["group"], pool_ref["name"]) == ("inference.networking.k8s.io", "longserve")
    # requests naming a session go to the proxy, which keeps the session on one pod
    proxy_ref = backends["Service", True]
    assert proxy_ref["name"] == proxy_service["metadata"]["name"]
    assert proxy_ref["port"] in {p["port"] for p in proxy_service["spec"]["ports"]}
    for rule in route["spec"]["rules"]:
        for match in rule["matches"]:
            for header in match.get("headers", []):
                assert header["name"] == "X-Longserve-Session"
