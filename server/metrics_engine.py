"""The engine's state as Prometheus families, read from `engine.stats()` at scrape time: longserve's
gauges and counters, and vLLM's three gauges the inference gateway's endpoint picker reads
(docs/decisions/062-kubernetes.md). Registered by server/metrics.py's `Metrics`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.protocol import EngineStats

PREFIX = "longserve:"
# The inference gateway's endpoint picker reads these names (vLLM's) by default.
VLLM_PREFIX = "vllm:"


def kv_cache_usage(stats: EngineStats, memory_tokens_budget: int) -> float:
    """vLLM's KV-cache usage (0 to 1) as longserve counts it: the tokens its sessions' memories
    hold over the most its tenants may hold (`max_memory_tokens_per_tenant` times the tenants),
    capped at 1. Kept prefixes are left out (docs/decisions/062-kubernetes.md)."""
    # No preallocated KV pool here: session memories are what stays and fills a replica.
    if memory_tokens_budget <= 0:
        return 0.0
    return min(1.0, stats.memory_tokens / memory_tokens_budget)


class EngineStatsCollector(Collector):
    """The gauges and counters of `engine.stats()`, read at scrape time."""

    def __init__(
        self, read_stats: Callable[[], EngineStats], model_name: str, memory_tokens_budget: int
    ) -> None:
        self._read_stats = read_stats
        self._model_name = model_name
        self._memory_tokens_budget = memory_tokens_budget

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._read_stats()
        except Exception:  # a dead engine must not break the scrape
            stats = EngineStats()
        yield from self._inference_gateway_gauges(stats)
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_running",
            "Requests running in the engine.",
            value=stats.num_requests_running,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_waiting",
            "Requests waiting in the engine's queue.",
            value=stats.num_requests_waiting,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}sessions_active", "Sessions holding memory.", value=stats.sessions_active
        )
        yield GaugeMetricFamily(
            f"{PREFIX}memory_tokens", "Tokens held in session memories.", value=stats.memory_tokens
        )
        yield GaugeMetricFamily(
            f"{PREFIX}sessions_offloaded",
            "Sessions whose memory was moved to host memory while idle.",
            value=stats.sessions_offloaded,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}sessions_on_disk",
            "Sessions whose memory blocks are in the disk tier.",
            value=stats.sessions_on_disk,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}memory_disk_bytes",
            "Bytes the disk tier's files span (memory blocks of every session).",
            value=stats.memory_disk_bytes,
        )
        counters = (
            ("prefix_cache_hits", "Long prompts that started from a kept memory.", "hits"),
            ("prefix_cache_misses", "Long prompts that found no kept memory.", "misses"),
            ("prefix_cache_tokens_reused", "Prompt tokens not read again.", "tokens_reused"),
            ("prefix_cache_evictions", "Kept memories evicted (LRU by bytes).", "evictions"),
            ("prefix_cache_store_hits", "Long prompts that imported stored chunks.", "store_hits"),
            (
                "prefix_cache_store_tokens_imported",
                "Prompt tokens imported from the memory store.",
                "store_tokens_imported",
            ),
            (
                "prefix_cache_store_chunks_written",
                "Long prompts' chunks written to the memory store.",
                "store_chunks_written",
            ),
            (
                "prefix_cache_store_failures",
                "Prefix store calls that failed (the request went on without it).",
                "store_failures",
            ),
        )
        for name, doc, field in counters:
            yield CounterMetricFamily(
                f"{PREFIX}{name}", doc, value=getattr(stats, f"prefix_cache_{field}")
            )
        yield GaugeMetricFamily(
            f"{PREFIX}prefix_cache_entries",
            "Memories kept for long prompts' prefix reuse.",
            value=stats.prefix_cache_entries,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}prefix_cache_bytes",
            "Bytes of the memories kept for prefix reuse.",
            value=stats.prefix_cache_bytes,
        )
        grammars = (
            ("grammars_compiled", "response_format grammars compiled.", stats.grammars_compiled),
            ("grammar_cache_hits", "response_format grammars reused.", stats.grammar_cache_hits),
            (
                "grammar_compile_seconds",
                "Seconds spent compiling response_format grammars.",
                stats.grammar_compile_seconds,
            ),
        )
        for name, doc, value in grammars:
            yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=value)

    def _inference_gateway_gauges(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM's names, types and label for what the endpoint picker reads. Not exported:
        `vllm:lora_requests_info` (longserve's answer adapters are model ids, `<model>:NAME`, not LoRA requests) and the optional
        `vllm:cache_config_info` (its block size and block count describe a paged pool)."""
        gauges = (
            (
                "num_requests_running",
                "Requests running in the engine.",
                stats.num_requests_running,
            ),
            (
                "num_requests_waiting",
                "Requests waiting in the engine's queue.",
                stats.num_requests_waiting,
            ),
            (
                "kv_cache_usage_perc",
                "Memory held by sessions over the tenants' memory budget. 1 means 100 percent.",
                kv_cache_usage(stats, self._memory_tokens_budget),
            ),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"{VLLM_PREFIX}{name}", doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
