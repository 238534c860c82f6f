"""The Grafana dashboard and its provisioning files, and the PromQL queries its panels run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from tests.deploy.tools import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "longserve.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "longserve.yml"


def dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [
        target["expr"]
        for panel in dashboard_panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]
