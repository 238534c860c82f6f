"""deploy/prometheus.yml (promtool, and one DNS-discovered job per service so every replica is
scraped) and deploy/prometheus-rules.yml (only known metrics)."""

from __future__ import annotations

import subprocess

from tests.deploy.metric_names import assert_known_metrics
from tests.deploy.tools import DEPLOY, require, yaml_module


def test_prometheus_config_passes_promtool() -> None:
    promtool = require("promtool", install="apt-get install prometheus")
    result = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_discovers_every_replica() -> None:
    config = yaml_module().safe_load((DEPLOY / "prometheus.yml").read_text())
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
    rules = yaml_module().safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert exprs
    # Rules may also read Prometheus's own series (`up`); any longserve one must exist.
    assert assert_known_metrics(exprs, allow_other=True)
