"""Long prompts' prefix memories through the memory store, for every replica (docs/decisions/035).

The prefix cache (engine/caches/prefix_cache.py) keeps memories in one replica's host memory, so a
chat whose next turn lands on another replica reads its document again. With
EngineConfig.prefix_cache_store, a long prompt's document is read with write-through, as a
session reads an upload (SessionMemory.ingest_chunk: each chunk's encodings exported in fp16,
and the fp16 copy committed): every whole chunk goes to the store under the prefix chain hash
h_j = chain_hash(h_{j-1}, chunk_j). A later prompt on any replica imports the stored chunks of
its own chain, one after another, with no forward, and reads only the rest.

Keys. Chunks are content-addressed like a session's documents, under a fingerprint of (model,
memory configuration, reading unit, scope): tenants never share a stored memory.

A store failure never fails the request: a lookup that fails reads from where it got, a write
that fails stops this request's writes. Device thread only, except `stats`.

Bounded per tenant (the scope): each chunk written is an entry in the tenant's usage ledger
(memory_store/usage.py, `prefix_entries`, item `prefix_entry_item`), claimed before the chunk
is put; past `max_entries` the request's writes stop, and it is answered all the same.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from engine.caches.store import StoreBridge, session_fingerprint
from engine.protocol import StoreUnavailableError
from memory_store.client import ChunkEncoding, chain_hash, prefix_entry_item
from memory_store.errors import NotFound

if TYPE_CHECKING:
    from engine.memory.session import SessionMemory

logger = logging.getLogger(__name__)

IN_FLIGHT = 4  # store calls one request keeps going while the device reads or imports


@dataclass(frozen=True)
class PrefixStoreStats:
    hits: int = 0  # long prompts that imported at least one stored chunk
    tokens_imported: int = 0  # prompt tokens imported from the store, summed over hits
    chunks_written: int = 0  # chunks this replica wrote
    failures: int = 0  # store calls that failed (the request went on without the store)


class PrefixStore:
    def __init__(
        self, bridge: StoreBridge, model_fingerprint: str, max_entries: int = 8192
    ) -> None:
        self._bridge = bridge
        self._model_fingerprint = model_fingerprint
        self.max_entries = max_entries  # per tenant (scope), across replicas
        self._hits = self._imported = self._written = self._failures = 0
        self._lock = threading.Lock()  # _written and _failures change on the bridge's loop too

    def stats(self) -> PrefixStoreStats:
        return PrefixStoreStats(self._hits, self._imported, self._written, self._failures)

    def fingerprint(self, memory: SessionMemory, scope: str | None, unit: int) -> str:
        """Where this memory's prefix chunks live: model, memory config, unit and scope."""
        record = f"prefix|{session_fingerprint(self._model_fingerprint, memory)}|{unit}|{scope}"
        return hashlib.sha256(record.encode()).hexdigest()

    def start(
        self,
        scope: str | None,
        memory: SessionMemory,
        ids: torch.Tensor,
        start: int,
        document_end: int,
        unit: int,
    ) -> Generator[None, None, tuple[int, tuple[int, ChunkWriter] | None]]:
        """For a long prompt of `scope` whose memory holds ids[:start]: import what the store
        holds of the rest of its document (`restore`), and the writer its reading puts the
        rest with (MemoryState's `write`). A memory that reads by the question (prefix_cache's
        keep_point) neither imports nor writes."""
        if memory.reads_by_question(unit):
            return start, None
        where = self.fingerprint(memory, scope, unit)
        done = yield from self.restore(memory, ids, start, document_end, unit, where)
        return done, (unit, ChunkWriter(self, where, scope))

    def restore(
        self,
        memory: SessionMemory,
        ids: torch.Tensor,
        start: int,
        document_end: int,
        unit: int,
        fingerprint: str,
    ) -> Generator[None, None, int]:
        """Import into `memory` (which holds ids[:start], start a multiple of unit) the stored
        chunks that continue it, in whole units before document_end; yields after each chunk
        (one unit of device work) and returns the tokens the memory now holds. The next
        IN_FLIGHT chunks are fetched while one is imported."""
        flat = ids.reshape(-1).cpu().numpy()
        pieces = [flat[end - unit : end] for end in range(start + unit, document_end, unit)]
        hashes, h = [], memory.state_hash
        for piece in pieces:
            h = chain_hash(h, piece)
            hashes.append(h)
        bridge = self._bridge
        fetches: deque[Future[ChunkEncoding]] = deque()
        done = start
        try:
            for i, piece in enumerate(pieces):
                while len(fetches) < IN_FLIGHT and i + len(fetches) < len(pieces):
                    h = hashes[i + len(fetches)]
                    fetches.append(bridge.submit(partial(bridge.client.get_chunk, fingerprint, h)))
                try:
                    encoding = bridge.wait("get_chunk", fetches.popleft())
                except NotFound:
                    break
                except StoreUnavailableError as e:
                    self._failed("reading", e)
                    break
                if list(encoding.token_ids) != piece.tolist():
                    break  # a hash collision: read it instead
                memory.import_chunk(encoding)
                done += unit
                yield None
        finally:
            for future in fetches:
                future.cancel()
        if done > start:
            self._hits += 1
            self._imported += done - start
        return done

    def _failed(self, what: str, error: StoreUnavailableError) -> None:
        with self._lock:
            self._failures += 1
        logger.warning("prefix memory store %s failed; going on without it: %s", what, error)


class ChunkWriter:
    """Puts one request's chunks, keyed by the chain hash the memory holds after each, without
    waiting for them (at most IN_FLIGHT at once: then it waits for the oldest; `flush` waits
    for all); after a failure it puts nothing more (the chain would have a hole)."""

    def __init__(self, store: PrefixStore, fingerprint: str, scope: str | None = None) -> None:
        self._store = store
        self._fingerprint = fingerprint
        self._scope = scope
        self._puts: deque[Future[bool]] = deque()
        self._broken = False
        self._full = False  # the tenant's entries are at max_entries: write no more
        self._ended: set[Future[bool]] = set()  # puts already counted

    def __call__(self, h: str, encoding: ChunkEncoding) -> None:
        bridge = self._store._bridge
        while self._puts and (self._puts[0].done() or len(self._puts) >= IN_FLIGHT):
            self._settle(self._puts.popleft())
        if self._broken or self._full:
            return
        try:
            put = bridge.submit(partial(self._put, h, encoding))
        except StoreUnavailableError as e:
            self._fail(e)
            return
        put.add_done_callback(self._end)
        self._puts.append(put)

    async def _put(self, h: str, encoding: ChunkEncoding) -> bool:
        """On the bridge's loop: count the entry in the tenant's ledger, then put the chunk.
        False, and no more writes, when the tenant is at max_entries."""
        client = self._store._bridge.client
        if self._scope is not None:
            claim = await client.claim_usage(
                self._scope,
                prefix_entry_item(self._fingerprint, h),
                {"prefix_entries": 1},
                {"prefix_entries": self._store.max_entries},
            )
            if not claim.granted:
                self._full = True
                return False
        return await client.put_chunk(self._fingerprint, h, encoding)

    def flush(self) -> None:
        """Wait for every put still in flight (the document is read)."""
        while self._puts:
            self._settle(self._puts.popleft())

    def _settle(self, put: Future[bool]) -> None:
        try:
            self._store._bridge.wait("put_chunk", put)
        except StoreUnavailableError as e:
            self._fail(e)
        self._end(put)

    def _fail(self, error: StoreUnavailableError) -> None:
        with self._store._lock:
            first, self._broken = not self._broken, True
        if first:
            self._store._failed("writing", error)

    def _end(self, put: Future[bool]) -> None:
        """Count a put once it has ended: when the request waits for it, or on the bridge's
        loop as it ends (also the last ones, which no request waits for)."""
        if not put.done() or put.cancelled():
            return
        error = put.exception()
        with self._store._lock:  # the device thread and the bridge's loop both count
            if put in self._ended:
                self._ended.discard(put)  # the other caller counted it; forget it
                return
            self._ended.add(put)
            if error is None:
                self._store._written += int(put.result())
        if error is not None:
            self._fail(StoreUnavailableError(f"memory store put_chunk failed: {error!r}"))
