"""The engine's side of the memory service: document encodings written once, sessions rebuilt
from them without the model (Decoupled Context Processing; docs/architecture.md section 4).

`StoreBridge` owns an asyncio loop in a daemon thread and runs the async `MemoryStoreClient`
there; the worker thread calls it synchronously (`run_coroutine_threadsafe(...).result(t)`), so
no torch runs in async code and no store I/O runs on the server's loop.

Keys. A chunk's encodings depend on the model, its dtype, the session's memory configuration
(the frame and the strategy decide what each chunk attends to) and everything read before it.
So chunks are keyed by a fingerprint of (model, dtype, memory config) and the prefix-chain hash
`h_i = chain_hash(h_{i-1}, tokens_i)` started from the session's own state hash (the chain of
all it has read, None for a fresh session): a document's encodings are shared only when its
context is identical, e.g. the first document of fresh sessions with the same memory config.
Sessions share chunks within one tenant only (`tenant_scope`): whether a chunk was already stored
shows in how fast a document is read, so a shared address would tell a tenant what another
uploaded (docs/decisions/059).

`ingest_steps` reads a document chunk by chunk (the memory's chunk_size): a chunk the store
holds is imported (no forward), any other is forwarded, exported and put (durable) before its
progress is reported; a manifest of the document follows the last chunk. When the store fails,
the rest of the document is still read into memory and the job ends with
`StoreUnavailableError` (the session works locally; the server answers 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from engine.config import EngineConfig
from engine.memory.frame import FRAME_LAYOUT
from engine.protocol import IngestProgress, StoreUnavailableError
from memory_store.client import (
    ChunkEncoding,
    DocumentManifest,
    MemoryStoreClient,
    chain_hash,
    embedded_client,
    http_client,
)
from memory_store.errors import InvalidStoreRequest, NotFound, StoreError

if TYPE_CHECKING:
    from engine.memory.session import SessionMemory

logger = logging.getLogger(__name__)

T = TypeVar("T")

FORMAT_VERSION = "lsce1-prerotary-kv"  # bump when what a chunk's encodings mean changes
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class StoreBridge:
    """Synchronous calls into an async MemoryStoreClient, for the engine's worker thread."""

    def __init__(
        self, client: MemoryStoreClient, timeout_s: float = 30.0, *, owns_client: bool = True
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._owns_client = owns_client  # False: the process's shared client, closed by its owner
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="longserve-memory-store", daemon=True
        )
        self._thread.start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, client: MemoryStoreClient | None = None
    ) -> StoreBridge | None:
        """A bridge over `client` (the process's own, which its owner closes), else over the
        store the config names (HTTP service or embedded data dir), or None."""
        if client is not None:
            return cls(client, timeout_s=config.memory_store_timeout_s, owns_client=False)
        if config.memory_store_url is not None:
            client = http_client(
                config.memory_store_url,
                timeout_s=config.memory_store_timeout_s,
                token=config.memory_store_token,
            )
        elif config.data_dir is not None:
            client = embedded_client(Path(config.data_dir) / "memory-store")
        else:
            return None
        return cls(client, timeout_s=config.memory_store_timeout_s)

    def _call(self, op: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        return self.wait(op, self.submit(make))

    def submit(self, make: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Start a client call on the bridge's loop and return at once (`wait` for it)."""
        if self._loop.is_closed():
            raise StoreUnavailableError("the memory store client is closed")
        return asyncio.run_coroutine_threadsafe(make(), self._loop)

    def wait(self, op: str, future: concurrent.futures.Future[T]) -> T:
        """A submitted call's result; NotFound passes through, other store failures (and no
        answer within timeout_s) raise StoreUnavailableError."""
        try:
            return future.result(self.timeout_s)
        except NotFound:
            raise
        except (StoreError, TimeoutError, OSError) as e:
            future.cancel()
            raise StoreUnavailableError(f"memory store {op} failed: {type(e).__name__}: {e}") from e

    async def acall(self, op: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """`_call` for the engine's asyncio side: awaits the client on the bridge's loop
        without blocking the caller's loop. NotFound passes through; other store failures
        become StoreUnavailableError."""
        if self._loop.is_closed():
            raise StoreUnavailableError("the memory store client is closed")
        future = asyncio.run_coroutine_threadsafe(make(), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except (NotFound, InvalidStoreRequest):
            raise
        except (StoreError, TimeoutError, OSError) as e:
            future.cancel()
            raise StoreUnavailableError(f"memory store {op} failed: {type(e).__name__}: {e}") from e

    def has_chunk(self, fingerprint: str, h: str) -> bool:
        return self._call("has_chunk", lambda: self.client.has_chunk(fingerprint, h))

    def get_chunk(self, fingerprint: str, h: str) -> ChunkEncoding:
        return self._call("get_chunk", lambda: self.client.get_chunk(fingerprint, h))

    def put_chunk(self, fingerprint: str, h: str, chunk: ChunkEncoding) -> bool:
        return self._call("put_chunk", lambda: self.client.put_chunk(fingerprint, h, chunk))

    def put_manifest(self, session_id: str, manifest: DocumentManifest) -> None:
        self._call(
            "put_manifest", lambda: self.client.put_manifest(session_id, manifest.doc_id, manifest)
        )

    def get_manifest(self, session_id: str, doc_id: str) -> DocumentManifest:
        return self._call("get_manifest", lambda: self.client.get_manifest(session_id, doc_id))

    def add_to_collection(
        self, name: str, fingerprint: str, hashes: Sequence[str], embeddings: np.ndarray
    ) -> int:
        return self._call(
            "add_to_collection",
            lambda: self.client.add_to_collection(name, fingerprint, hashes, embeddings),
        )

    def delete_session(self, session_id: str) -> int:
        return self._call("delete_session", lambda: self.client.delete_session(session_id))

    def drop_unnamed_chunks(self, session_id: str, fingerprint: str, hashes: list[str]) -> int:
        return self._call(
            "drop_unnamed_chunks",
            lambda: self.client.drop_unnamed_chunks(session_id, fingerprint, list(hashes)),
        )

    def close(self) -> None:
        """Close the client (when this bridge owns it) and stop the loop thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            if self._owns_client:
                asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(5.0)
        except Exception:  # closing is best effort
            logger.warning("closing the memory store client failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._loop.is_running():
            self._loop.close()


# ---------------------------------------------------------------------------------------------
# Fingerprints.
# ---------------------------------------------------------------------------------------------


def model_fingerprint(model_id: str, model: torch.nn.Module) -> str:
    """Hash of the model id, its config, its dtype and a sample of every weight tensor (so two
    checkpoints under one name do not share encodings)."""
    digest = hashlib.sha256(FORMAT_VERSION.encode())
    digest.update(model_id.encode())
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
            digest.update(param.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def session_fingerprint(model_fp: str, memory: SessionMemory) -> str:
    """Fingerprint of (model, the session's memory strategy and configuration)."""
    config = dataclasses.asdict(memory.config)
    record = {
        "model": model_fp,
        "strategy": memory.strategy,
        "config": config,
        "frame_layout": FRAME_LAYOUT,  # encodings depend on the frame a chunk attended
    }
    if memory.window_dtype != memory.model_dtype:  # ... and on the precision of its window
        record["window_dtype"] = str(memory.window_dtype)
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


def tenant_scope(session_id: str) -> str | None:
    """The tenant part of an engine session id: the server names its sessions
    `<tenant>.<session>` (server/auth.tenant_session_id); ids without a "." (`longserve ingest`'s
    throwaway sessions, tests) are unscoped."""
    tenant, dot, _ = session_id.partition(".")
    return tenant if dot and tenant else None


def scoped_fingerprint(fingerprint: str, scope: str | None) -> str:
    """Where a scope's chunks live: unscoped chunks (collections) keep the plain fingerprint."""
    if scope is None:
        return fingerprint
    return hashlib.sha256(f"tenant|{scope}|{fingerprint}".encode()).hexdigest()


def document_id(request_id: str) -> str:
    """A store-safe document id from the ingest request id."""
    cleaned = _BAD_ID_CHARS.sub("-", request_id).lstrip("._-")[:200]
    return cleaned or hashlib.sha256(request_id.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Ingest through the store.
# ---------------------------------------------------------------------------------------------


def ingest_steps(
    bridge: StoreBridge,
    model_fp: str,
    memory: SessionMemory,
    ids: list[int],
    *,
    session_id: str,
    doc_id: str,
    decode: Callable[[list[int]], str],
    started: float,
    on_read: Callable[[], None],
) -> Iterator[IngestProgress]:
    """Read `ids` into `memory` through the store; one step (IngestProgress) per chunk. See the
    module docstring. `on_read` runs once the memory holds the whole document, before the last
    progress (done=True) or the outage error goes out: a consumer that stops there (the server
    closes the stream at done) must find the document read (docs/decisions/055)."""
    fingerprint = scoped_fingerprint(
        session_fingerprint(model_fp, memory), tenant_scope(session_id)
    )
    chunk = memory.config.chunk_size
    total = len(ids)
    done = from_store = 0
    hashes: list[str] = []
    outage: StoreUnavailableError | None = None
    put: list[str] = []  # chunks this reading wrote and no manifest names yet
    try:
        for start in range(0, total, chunk):
            piece = ids[start : start + chunk]
            h = chain_hash(memory.state_hash, piece)
            encoding = None
            if outage is None:
                try:
                    encoding = bridge.get_chunk(fingerprint, h)
                except NotFound:
                    encoding = None  # not stored yet: forward and put it
                except StoreUnavailableError as e:
                    outage = _note_outage(e, session_id)
            if encoding is not None and list(encoding.token_ids) == piece:
                memory.import_chunk(encoding)
                from_store += len(piece)
            else:
                _, encoding = memory.ingest_chunk(
                    torch.tensor(piece, dtype=torch.long), text=decode(piece)
                )
                if outage is None:
                    try:
                        bridge.put_chunk(fingerprint, h, encoding)
                        put.append(h)
                    except StoreUnavailableError as e:
                        outage = _note_outage(e, session_id)
            assert memory.state_hash == h
            hashes.append(h)
            done += len(piece)
            last = done == total
            if not last:
                yield IngestProgress(
                    done, total, time.perf_counter() - started, tokens_from_store=from_store
                )
        if outage is None and hashes:
            manifest = DocumentManifest(
                doc_id,
                fingerprint,
                tuple(hashes),
                num_tokens=total,
                meta={"strategy": memory.strategy},
            )
            try:
                bridge.put_manifest(session_id, manifest)
                put.clear()  # named now: the session's deletion reclaims them
            except StoreUnavailableError as e:
                outage = _note_outage(e, session_id)
    finally:
        if put and outage is None:  # cut short (closed, or failed): nothing will name them
            _drop_unnamed(bridge, session_id, fingerprint, put)
    on_read()
    if outage is not None:
        raise StoreUnavailableError(
            f"the document was read into session {session_id!r}'s memory, but its encodings "
            f"are not stored: {outage}"
        ) from outage
    yield IngestProgress(
        done, total, time.perf_counter() - started, done=True, tokens_from_store=from_store
    )


def _drop_unnamed(bridge: StoreBridge, session_id: str, fingerprint: str, put: list[str]) -> None:
    """A reading cut short deletes the chunks it put that no manifest of its tenant names:
    else they wait out the grace sweep, counted by no ledger (docs/decisions/061)."""
    try:
        bridge.drop_unnamed_chunks(session_id, fingerprint, put)
    except (StoreError, StoreUnavailableError) as e:  # the grace sweep deletes them later
        logger.info("dropping %d unnamed chunks of %s failed: %s", len(put), session_id, e)


def _note_outage(error: StoreUnavailableError, session_id: str) -> StoreUnavailableError:
    logger.warning(
        "memory store unavailable while ingesting into session %s; reading the rest "
        "of the document into memory only: %s",
        session_id,
        error,
    )
    return error
