"""The engine's gauges and counters at one instant (`EngineStats`), read from its parts."""

from __future__ import annotations

from engine.caches.kv_prefix import KVPrefixCache
from engine.caches.prefix_cache import summed
from engine.caches.prefix_store import PrefixStoreStats
from engine.protocol import EngineStats
from engine.runner.grammar import Grammars
from engine.scheduler.worker import Worker
from engine.sessions.frame_backend import FrameBackend


def engine_stats(
    worker: Worker, frames: FrameBackend, kv_prefixes: KVPrefixCache, grammars: Grammars
) -> EngineStats:
    """What `/metrics` scrapes: queue depths, sessions and their tiers, prefix caches, grammars."""
    sessions = list(frames.conversations.values())
    prefixes = summed(frames.prefixes.stats(), kv_prefixes.stats())
    shared = frames.prefix_store
    stored = shared.stats() if shared is not None else PrefixStoreStats()
    return EngineStats(
        num_requests_running=worker.num_running,
        num_requests_waiting=worker.num_waiting,
        sessions_active=len(sessions),
        memory_tokens=sum(int(s.memory.num_tokens) for s in sessions),
        sessions_offloaded=sum(1 for s in sessions if s.memory.offloaded),
        sessions_on_disk=sum(1 for s in sessions if s.memory.on_disk),
        memory_disk_bytes=arena.used if (arena := frames.arena) else 0,
        prefix_cache_hits=prefixes.hits,
        prefix_cache_misses=prefixes.misses,
        prefix_cache_tokens_reused=prefixes.tokens_reused,
        prefix_cache_evictions=prefixes.evictions,
        prefix_cache_entries=prefixes.entries,
        prefix_cache_bytes=prefixes.bytes,
        prefix_cache_store_hits=stored.hits,
        prefix_cache_store_tokens_imported=stored.tokens_imported,
        prefix_cache_store_chunks_written=stored.chunks_written,
        prefix_cache_store_failures=stored.failures,
        grammars_compiled=grammars.compiled,
        grammar_cache_hits=grammars.cache_hits,
        grammar_compile_seconds=grammars.compile_seconds_total,
    )
