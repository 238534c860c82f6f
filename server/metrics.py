"""Prometheus metrics, named after vLLM's with the `longserve:` prefix.

With server/metrics_engine.py, the only modules that touch prometheus_client. Each app owns
one `Metrics` (its own CollectorRegistry), so tests can build many apps in one process. Gauges that describe the
engine's state are read from `engine.stats()` at scrape time (server/metrics_engine.py).

Beside them, under vLLM's own names, the three gauges that the Gateway API Inference Extension's
endpoint picker and llm-d read from every model server ("model server protocol"):
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, each with
vLLM's `model_name` label (docs/decisions/062-kubernetes.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from engine.protocol import EngineStats, RequestStats
from memory_store.client import stored_bytes
from server.metrics_engine import PREFIX, EngineStatsCollector

# 1 ms .. 2 min: TTFT and e2e on a long document span four orders of magnitude.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
    120.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    60.0,
)
INGEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The `_created` series double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()


class Metrics:
    def __init__(
        self,
        read_stats: Callable[[], EngineStats],
        *,
        model_name: str,
        memory_tokens_budget: int,
    ) -> None:
        """`model_name`: the served model (vLLM's label); `memory_tokens_budget`: the memory
        tokens this server's tenants may hold in all (see `kv_cache_usage`)."""
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(EngineStatsCollector(read_stats, model_name, memory_tokens_budget))
        r = self.registry

        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time to the first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "End-to-end latency of a request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "Time a request waited in the queue.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prefill_time = Histogram(
            f"{PREFIX}request_prefill_time_seconds",
            "Time a request spent in prefill.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Tokens generated.", registry=r
        )
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.ingest_tokens = Counter(
            f"{PREFIX}ingest_tokens", "Document tokens read into memory.", registry=r
        )
        self.ingest_seconds = Histogram(
            f"{PREFIX}ingest_seconds",
            "Time spent reading documents into memory.",
            buckets=INGEST_BUCKETS,
            registry=r,
        )
        self.retrieval_seconds = Histogram(
            f"{PREFIX}retrieval_seconds",
            "Time a request spent retrieving from memory.",
            ["strategy"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.memory_store_requests = Counter(
            f"{PREFIX}memory_store_requests",
            "Requests to the memory store.",
            ["op", "backend", "status"],
            registry=r,
        )
        self.memory_store_request_seconds = Histogram(
            f"{PREFIX}memory_store_request_seconds",
            "Latency of requests to the memory store.",
            ["op", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        # Per tenant, as the memory store's usage ledger last answered this replica
        # (server/sessions/usage.py, server/serving/response_store.py).
        self.tenant_stored_bytes = Gauge(
            f"{PREFIX}tenant_stored_bytes",
            "Bytes a tenant holds in the memory store (document texts, stored responses).",
            ["tenant"],
            registry=r,
        )
        # What this replica's sweeps of the memory store gave back (memory_store/reclaim.py).
        self.memory_store_reclaimed_bytes = Counter(
            f"{PREFIX}memory_store_reclaimed_bytes",
            "Bytes this replica's memory store sweeps deleted.",
            registry=r,
        )
        self.memory_store_reclaimed = Counter(
            f"{PREFIX}memory_store_reclaimed",
            "Sessions, records and blobs, and chunks this replica's memory store sweeps deleted.",
            ["kind"],
            registry=r,
        )

    # --- helpers the serving code calls --------------------------------------------------------

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def inter_token(self, seconds: float, tokens: int = 1) -> None:
        """A delta carrying `tokens` tokens arrived `seconds` after the previous one."""
        if tokens <= 0:
            return
        per_token = seconds / tokens
        for _ in range(tokens):
            self.inter_token_latency.observe(per_token)

    def request_finished(
        self,
        *,
        finish_reason: str,
        e2e_seconds: float,
        prompt_tokens: int,
        generation_tokens: int,
        stats: RequestStats | None,
    ) -> None:
        """One engine request (one choice) ended; `stats` comes from its last delta."""
        self.e2e_request_latency.observe(e2e_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.request_success.labels(finished_reason=finish_reason).inc()
        if stats is None:
            return
        self.request_queue_time.observe(stats.queue_seconds)
        self.request_prefill_time.observe(stats.prefill_seconds)
        if stats.strategy is not None:
            self.retrieval_seconds.labels(strategy=stats.strategy).observe(stats.retrieval_seconds)
        if stats.ingest_tokens:
            self.ingest_tokens.inc(stats.ingest_tokens)
            self.ingest_seconds.observe(stats.ingest_seconds)

    def ingest_finished(self, tokens: int, seconds: float) -> None:
        """A document ingestion (through the sessions API) ended; `tokens` counts only those
        the model ran over, not those rebuilt from the memory store's encodings."""
        self.ingest_tokens.inc(tokens)
        self.ingest_seconds.observe(seconds)

    def memory_store_request(
        self, op: str, backend: str, status: str, seconds: float | None = None
    ) -> None:
        """One call to the memory store ended (the client's `on_request` hook)."""
        self.memory_store_requests.labels(op=op, backend=backend, status=status).inc()
        if seconds is not None:
            self.memory_store_request_seconds.labels(op=op, backend=backend).observe(seconds)

    def tenant_usage(self, tenant: str, totals: dict[str, int]) -> None:
        """The tenant's usage ledger totals, as the store answered them."""
        self.tenant_stored_bytes.labels(tenant=tenant).set(stored_bytes(totals))

    def memory_store_reclaimed_report(self, report: Mapping[str, int]) -> None:
        """A memory store sweep's report (`MemoryStoreClient.reclaim`)."""
        self.memory_store_reclaimed_bytes.inc(report.get("bytes_reclaimed", 0))
        for kind in ("sessions", "keys", "chunks"):
            self.memory_store_reclaimed.labels(kind=kind).inc(report.get(f"{kind}_deleted", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
