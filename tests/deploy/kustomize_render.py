"""deploy/k8s rendered by kustomize, as `kubectl apply -k` would send it: a copy of the tree
with the committed secrets.env.example as its secrets.env, so that a developer's real secrets
are never read."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import DEPLOY, REPO, tool, yaml_module

K8S = DEPLOY / "k8s"
SECRETS_EXAMPLE = K8S / "base" / "secrets.env.example"
# What `kubectl apply -k` is pointed at (the base is rendered too, though not applied alone).
RENDERED = ("base", "overlays/cpu", "overlays/gpu", "overlays/cpu-external-redis")
WORKLOADS = {"Deployment", "StatefulSet"}
FETCH_KUSTOMIZE = "deploy/k8s/get-kustomize.sh"


def kustomize_command() -> list[str]:
    """kustomize build: the binary get-kustomize.sh fetched, or one on PATH, or kubectl's own."""
    kustomize = tool("kustomize", REPO / ".cache" / "tools" / "kustomize")
    if kustomize:
        return [kustomize, "build"]
    kubectl = tool("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    reason = (
        f"kustomize is not installed: run {FETCH_KUSTOMIZE} (Debian's, checked, into "
        ".cache/tools; .ci/run does) or put kustomize or kubectl on PATH"
    )
    warnings.warn(f"Kubernetes manifests not rendered: {reason}", stacklevel=2)
    pytest.skip(reason)


def secrets_example() -> dict[str, str]:
    pairs = (
        line.split("=", 1)
        for line in SECRETS_EXAMPLE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    return {key: value for key, value in pairs}


def render_all(workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every entry of RENDERED, rendered from a copy of deploy/k8s under `workdir`."""
    yaml = yaml_module()
    command = kustomize_command()
    tree = workdir / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets.env"))
    shutil.copy(SECRETS_EXAMPLE, tree / "base" / "secrets.env")
    documents = {}
    for name in RENDERED:
        result = subprocess.run(
            [*command, str(tree / name)], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, f"{name}: {result.stderr}"
        documents[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return documents


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml_module().safe_load_all(path.read_text()) if doc]


def find(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        doc
        for doc in documents
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def of_kind(documents: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [doc for doc in documents if doc["kind"] in kinds]


def containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from workload["spec"]["template"]["spec"]["containers"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = (c for c in containers(workload) if c["name"] == name)
    return found


def env(container_spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in container_spec.get("env", [])}


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()
