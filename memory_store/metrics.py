"""Prometheus metrics of the memory service. The only module here that imports prometheus_client."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class MemoryStoreMetrics:
    """Its own registry, so several apps (and tests) in one process never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "longserve:memory_store_requests",
            "Memory store requests by operation, backend and outcome.",
            ["op", "backend", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "longserve:memory_store_request_seconds",
            "Memory store request latency by operation and backend.",
            ["op", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

        # What the store gave back (memory_store/reclaim.py).
        self.reclaimed_bytes = Counter(
            "longserve:memory_store_reclaimed_bytes",
            "Bytes the memory store deleted: sessions deleted or expired, unused chunks.",
            registry=self.registry,
        )
        self.reclaimed = Counter(
            "longserve:memory_store_reclaimed",
            "Sessions, records and blobs, and chunks the memory store deleted, by kind.",
            ["kind"],
            registry=self.registry,
        )

    def count_reclaimed(self, report: Mapping[str, int]) -> None:
        """Add a ReclaimReport's `to_record()`."""
        self.reclaimed_bytes.inc(report.get("bytes_reclaimed", 0))
        for kind in ("sessions", "keys", "chunks"):
            self.reclaimed.labels(kind=kind).inc(report.get(f"{kind}_deleted", 0))

    def observe(self, op: str, backend: str, status: str, seconds: float) -> None:
        """Matches the client's `RequestHook` signature, so it can be passed as one."""
        self.requests.labels(op=op, backend=backend, status=status).inc()
        self.latency.labels(op=op, backend=backend).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
