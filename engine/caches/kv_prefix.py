"""Prefix reuse for prompts that fit the window: the plain KV path's keys and values, kept.

Chat clients resend the whole conversation every turn and users ask many questions of one
document, so a prompt that fits the window usually starts with the tokens of an earlier one.
Without reuse every such prompt is read again from its first token: a 7.7K-token prompt is
about 20 s of prefill on a 2-core CPU. Like vLLM's automatic prefix caching, the keys and values
a prompt's prefill wrote are kept per whole block of tokens, and a later prompt of the same
scope (tenant) that starts with the same blocks copies them into its cache and reads only the
rest (reported as the usage's cached_tokens).

A block is one prefill chunk (EngineConfig.prefill_chunk_tokens, 512): the rest of a prompt is
then read in the very forwards a prompt read from scratch runs, and a forward's keys, values
and logits depend on its rows, so the answer is the one the prompt gets with nothing kept, bit
for bit (docs/decisions/073).

Keys are chain hashes over the prompt's blocks from its start (memory_store/encodings.py's
`chain_hash`, next to the scope), so a block's hash names every token before it. An entry holds
one prompt's blocks; every one of its hashes points to it, so a prompt that shares only its
first blocks finds it too. An entry whose blocks begin a newer one's is dropped for it.
Bounded: an LRU by bytes (EngineConfig.kv_prefix_cache_bytes); 0 keeps none. A request copies
what it reuses, so evicting never touches a request under way. Device thread only, except
`stats`. Long prompts answered through memory have their own reuse (prefix_cache.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.caches.prefix_cache import PrefixCacheStats
from memory_store.client import chain_hash

if TYPE_CHECKING:
    from engine.runner.kv_cache import KVCache


def block_hashes(scope: str | None, token_ids: torch.Tensor, limit: int, block: int) -> list[str]:
    """The chain hashes of the first `limit` // block whole blocks of token_ids, salted with
    the scope so that no tenant can find another's keys."""
    ids = token_ids.tolist()
    hashes: list[str] = []
    previous = chain_hash(None, list((scope or "").encode()))
    for start in range(0, (limit // block) * block, block):
        previous = chain_hash(previous, ids[start : start + block])
        hashes.append(previous)
    return hashes


@dataclass
class _Entry:
    kv: torch.Tensor  # (layers, 2, kv_heads, blocks * block, d), the cache's dtype
    hashes: list[str]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class KVPrefixCache:
    """Kept keys and values of plain prompts' whole blocks, by chain hash, LRU by bytes."""

    def __init__(self, max_bytes: int, block: int) -> None:
        self.max_bytes, self.block = max_bytes, block
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # by last hash, LRU first
        self._index: dict[str, tuple[str, int]] = {}  # block hash -> (entry, blocks it covers)
        self._bytes = 0
        self._lock = threading.Lock()  # `stats` is read from the event loop
        self._hits = self._misses = self._reused = self._evictions = 0

    def start(self, scope: str | None, token_ids: torch.Tensor, cache: KVCache) -> int:
        """Fill the empty `cache` with the longest kept prefix of token_ids (whole blocks, at
        least one token left to read, for the logits); the tokens it now holds."""
        if self.max_bytes == 0:
            return 0
        found: tuple[str, int] | None = None
        for hashed in block_hashes(scope, token_ids, len(token_ids) - 1, self.block):
            if hashed not in self._index:
                break
            found = self._index[hashed]
        with self._lock:
            if found is None:
                self._misses += 1
                return 0
            name, blocks = found
            entry = self._entries[name]
            self._entries.move_to_end(name)
            tokens = blocks * self.block
            self._hits += 1
            self._reused += tokens
        cache.start_from(entry.kv[:, :, :, :tokens])
        return tokens

    def keep(self, scope: str | None, token_ids: torch.Tensor, cache: KVCache) -> None:
        """After the prompt's prefill: keep the whole blocks `cache` holds of token_ids."""
        if self.max_bytes == 0:
            return
        hashes = block_hashes(scope, token_ids, min(len(token_ids), cache.num_tokens), self.block)
        if not hashes:
            return
        if hashes[-1] in self._index:  # kept already, alone or at the start of a longer prompt
            with self._lock:
                self._entries.move_to_end(self._index[hashes[-1]][0])
            return
        kv = cache.prefix(len(hashes) * self.block)
        entry = _Entry(kv, hashes)
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            for hashed in hashes:  # an entry this one begins with is this one's first blocks
                if hashed in self._entries:
                    self._drop(hashed)
            self._entries[hashes[-1]] = entry
            self._bytes += entry.nbytes
            for blocks, hashed in enumerate(hashes, 1):
                self._index[hashed] = (hashes[-1], blocks)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self._evictions += 1

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name)
        self._bytes -= entry.nbytes
        for hashed in entry.hashes:
            if self._index.get(hashed, (None,))[0] == name:
                del self._index[hashed]
                self._point_elsewhere(hashed)

    def _point_elsewhere(self, hashed: str) -> None:
        """Index `hashed` in another entry that holds it, if one does (the newest)."""
        for name in reversed(self._entries):
            hashes = self._entries[name].hashes
            if hashed in hashes:
                self._index[hashed] = (name, hashes.index(hashed) + 1)
                return

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                hits=self._hits,
                misses=self._misses,
                tokens_reused=self._reused,
                entries=len(self._entries),
                bytes=self._bytes,
                evictions=self._evictions,
            )


class PromptReuse:
    """One request's use of a KVPrefixCache for its own KVCache (engine/runner/generate.py's
    `reuse`): `start` before its prefill, `keep` after it."""

    def __init__(self, kept: KVPrefixCache, scope: str | None, cache: KVCache) -> None:
        self._kept, self._scope, self._cache = kept, scope, cache

    def start(self, token_ids: torch.Tensor) -> int:
        return self._kept.start(self._scope, token_ids, self._cache)

    def keep(self, token_ids: torch.Tensor) -> None:
        self._kept.keep(self._scope, token_ids, self._cache)
