"""The Grafana dashboard: its queries read only known metrics and parse as PromQL, it is wired
to the provisioned datasource, and compose mounts what the provisioning expects."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.deploy.dashboard import (
    DASHBOARD_PROVIDERS,
    DATASOURCES,
    dashboard_exprs,
    dashboard_panels,
    load_dashboard,
)
from tests.deploy.metric_names import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    assert_known_metrics,
    metric_family,
)
from tests.deploy.tools import require, yaml_module


def test_dashboard_queries_only_known_metrics() -> None:
    families = {metric_family(name) for name in assert_known_metrics(dashboard_exprs())}
    # The panels the issue asks for: TTFT, ITL, throughput, queue, ingest, retrieval,
    # memory size, sessions, memory-store traffic.
    wanted = HISTOGRAMS | COUNTERS | GAUGES
    assert wanted <= families, f"no panel for {sorted(wanted - families)}"


def test_dashboard_is_wired_to_the_provisioned_datasource() -> None:
    yaml = yaml_module()
    (datasource,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"

    dashboard = load_dashboard()
    assert dashboard["uid"] == "longserve"
    ids = [panel["id"] for panel in dashboard_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard_panels(dashboard["panels"]):
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
    promtool = require("promtool", install="apt-get install prometheus")
    exprs = [expr.replace("$__rate_interval", "5m") for expr in dashboard_exprs()]
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
