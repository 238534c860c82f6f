"""Automatic prefix reuse for long prompts answered through memory (docs/decisions/026).

A prompt too long for the window (inline, no session) is read into a memory that ends with the
request. Chat clients resend the whole conversation every turn, and users ask many questions
of one document, so the next long prompt usually starts with the same tokens. While a prompt's
document is read, the memory at one chunk boundary near the document's end is kept (a fork,
in host memory); a later prompt of the same scope (tenant) and memory configuration that
starts with the same chunks starts from a fork of it and reads only the rest.

Keys are the prefix chain of the encoder-output store (engine/caches/store.py): h_j =
chain_hash(h_{j-1}, chunk_j) over the prompt's chunks of `unit` tokens from its start, next to
the scope and a fingerprint of the memory's configuration. A memory holds exactly what the
chunks it read, in order, made of it, so an equal chain means an equal memory.

Bounded: an LRU by bytes (EngineConfig.prefix_cache_bytes). A request works on its own fork,
so evicting an entry never touches a request under way. Device thread only, except `stats`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memory_store.client import chain_hash

if TYPE_CHECKING:
    from engine.memory.session import SessionMemory

# A later prompt may differ from this one in its last MARGIN tokens before the question's tail
# (a different question, the next turn's message) and still find the copy kept for this one.
MARGIN = 256


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int = 0  # long prompts that started from a kept memory
    misses: int = 0  # long prompts that found none
    tokens_reused: int = 0  # prompt tokens not read again, summed over hits
    entries: int = 0
    bytes: int = 0
    evictions: int = 0


def summed(*stats: PrefixCacheStats) -> PrefixCacheStats:
    """Several prefix caches' counts together (long prompts' memories, plain prompts' keys)."""
    fields = [f.name for f in dataclasses.fields(PrefixCacheStats)]
    return PrefixCacheStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})


@dataclass
class _Entry:
    memory: SessionMemory
    tokens: int
    nbytes: int


def reading_units(chunk_size: int, prefill_chunk_tokens: int) -> tuple[int, int]:
    """(tokens per prefill step, tokens per forward) for reading a document so that every
    forward is `unit` tokens from the prompt's start, whatever the step size: steps are a
    multiple of the memory's chunk_size, or one forward each when shorter."""
    if prefill_chunk_tokens >= chunk_size:
        step = prefill_chunk_tokens // chunk_size * chunk_size
        return step, chunk_size
    return prefill_chunk_tokens, prefill_chunk_tokens


def memory_fingerprint(memory: SessionMemory) -> str:
    """The memory's strategy and configuration (the model is the engine's only one)."""
    record = {"strategy": memory.strategy, "config": dataclasses.asdict(memory.config)}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


class PrefixCache:
    def __init__(self, capacity_bytes: int, margin: int = MARGIN) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0 (0 keeps nothing)")
        self.capacity_bytes = capacity_bytes
        self.margin = margin
        self._entries: OrderedDict[tuple[str | None, str, str], _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._reused = self._evictions = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self._hits, self._misses, self._reused, len(self._entries), self._bytes,
            self._evictions,
        )  # fmt: skip

    def keep_point(self, memory: SessionMemory, document_end: int, unit: int) -> int | None:
        """Where a prompt whose document ends at document_end keeps a copy of its memory:
        the last chunk boundary at least `margin` tokens before that end. None: too short, or
        a memory whose document reading depends on the question (it retrieves while reading,
        with the text prior), which no other question may reuse."""
        if not self.capacity_bytes or memory.reads_by_question(unit):
            return None
        point = (document_end - self.margin) // unit * unit
        return point if point > 0 else None

    def start(
        self,
        scope: str | None,
        memory: SessionMemory,
        ids: torch.Tensor,
        document_end: int,
        unit: int,
    ) -> tuple[SessionMemory, int]:
        """A fork of the kept memory that read the longest prefix of ids (T,) in whole chunks
        before document_end, and the tokens it read; else (memory, 0). `memory` is the new,
        empty memory the prompt would read into: its configuration is part of the key."""
        if not self.capacity_bytes or memory.reads_by_question(unit):
            return memory, 0
        fingerprint = memory_fingerprint(memory)
        flat = ids.reshape(-1).cpu().numpy()
        h: str | None = None
        found: tuple[int, tuple[str | None, str, str]] | None = None
        for end in range(unit, document_end, unit):
            h = chain_hash(h, flat[end - unit : end])
            key = (scope, fingerprint, h)
            if key in self._entries:
                found = (end, key)
        if found is None:
            self._misses += 1
            return memory, 0
        tokens, key = found
        self._entries.move_to_end(key)
        fork = self._entries[key].memory.fork()
        self._hits += 1
        self._reused += tokens
        return fork, tokens

    def put(self, scope: str | None, memory: SessionMemory) -> None:
        """Keep a copy of `memory` (its state right now) for later prompts of `scope`."""
        if memory.state_hash is None or not self.capacity_bytes:
            return
        key = (scope, memory_fingerprint(memory), memory.state_hash)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        memory.embed_prior()  # EmbD of the blocks read: the question would embed them anyway
        nbytes = memory.nbytes()
        if nbytes > self.capacity_bytes:
            return
        while self._entries and self._bytes + nbytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
        kept = memory.fork()
        kept.end_request()  # no question, no decode caches
        kept.offload()  # host memory: the device keeps room for running requests
        # ... and its blocks in the disk tier when the server has one (mapped.py): kept
        # copies of 128K prompts held in RAM took a 24 GB server out of memory (decision 077)
        kept.spill()
        self._entries[key] = _Entry(kept, memory.num_tokens, nbytes)
        self._bytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
