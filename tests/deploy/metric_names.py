"""The metric names a deployment may query (docs/architecture.md section 7, and what server/metrics.py
exports beyond it), and the check that a query reads only those."""

from __future__ import annotations

import re

# docs/architecture.md section 7, as exposed by prometheus_client (counters end in _total).
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


def assert_known_metrics(exprs: list[str], *, allow_other: bool = False) -> set[str]:
    queried: set[str] = set()
    for expr in exprs:
        names = set(METRIC_NAME.findall(expr))
        assert names or allow_other, f"query reads no longserve metric: {expr}"
        unknown = names - KNOWN_SERIES
        assert not unknown, f"{expr} reads unknown metric(s) {sorted(unknown)}"
        queried |= names
    return queried


def metric_family(series: str) -> str:
    """The metric family a series belongs to: a histogram's _bucket/_sum/_count drop off."""
    family = re.sub(r"_(bucket|sum|count)$", "", series)
    return family if family in HISTOGRAMS | EXTRA_HISTOGRAMS else series
