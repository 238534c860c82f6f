"""The metric names the deployment files query against the code that exports them."""

from __future__ import annotations

import re

from tests.deploy.dashboard import dashboard_exprs
from tests.deploy.metric_names import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    assert_known_metrics,
    metric_family,
)
from tests.deploy.tools import REPO


def test_metric_names_match_the_code_that_exports_them() -> None:
    # server/metrics.py and metrics_engine.py export most; the memory service its own.
    source = "\n".join(
        path.read_text()
        for package in ("server", "memory_store")
        for path in sorted((REPO / package).rglob("metrics*.py"))
    )
    dashboard = {metric_family(name) for name in assert_known_metrics(dashboard_exprs())}
    for name in sorted(HISTOGRAMS | COUNTERS | GAUGES | dashboard):
        stem = re.escape(name.removeprefix("longserve:").removesuffix("_total"))
        # "longserve:name" literally, or f"{PREFIX}name"
        assert re.search(rf"(?:longserve:|\}}){stem}[\"']", source), f"nothing exports {name}"
