"""The typed async client the engine and the server use to reach the memory service.

`MemoryStoreClient` (client_api.py) is the API; two implementations sit behind it:

- `in_process_client(backend)` (`client_inprocess.py`): wraps the store over a backend in this
  process (the embedded default; also works over Redis without the HTTP hop).
  `embedded_client(data_dir)` is that over an `EmbeddedBackend` at `data_dir`.
- `http_client(base_url)` (`client_http.py`): httpx to a remote `longserve
  memory-store`, with bounded retries and backoff; a restarted service is picked up on the next
  call.

Both raise the same exception tree (`memory_store.errors.StoreError` and children) and report
every call to an optional `on_request(op, backend, status, seconds)` hook, which the server turns
into `longserve:memory_store_requests_total` (this module never imports prometheus_client).

server/ and engine/ import only this module and `memory_store.errors`, so the types they exchange
with the store are re-exported here.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from memory_store.backends import Backend, EmbeddedBackend
from memory_store.client_api import MemoryStoreClient
from memory_store.embedder import Embedder, TextEncoder, bundled_model_path
from memory_store.encodings import (
    ChunkEncoding,
    ChunkRef,
    DocumentManifest,
    Quantization,
    chain_hash,
)
from memory_store.errors import StoreUnavailableError
from memory_store.keys import KeySpace
from memory_store.larimar import LarimarConfig, LarimarHit, split_sentences
from memory_store.observed import RequestHook
from memory_store.retry import RetryPolicy
from memory_store.usage import UsageClaim, prefix_entry_item, stored_bytes

__all__ = [
    "Backend",
    "ChunkEncoding",
    "ChunkRef",
    "DocumentManifest",
    "KeySpace",
    "LarimarConfig",
    "LarimarHit",
    "MemoryStoreClient",
    "Quantization",
    "RequestHook",
    "RetryPolicy",
    "TextEncoder",
    "UsageClaim",
    "bundled_model_path",
    "chain_hash",
    "default_embedder",
    "embedded_client",
    "http_client",
    "in_process_client",
    "prefix_entry_item",
    "split_sentences",
    "stored_bytes",
    "wait_until_ready",
]


def default_embedder() -> Embedder:
    """The process-wide sentence encoder, looked up in `memory_store.embedder` at each call."""
    from memory_store import embedder

    return embedder.default_embedder()


def in_process_client(
    backend: Backend,
    *,
    encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
    larimar: LarimarConfig | None = None,
    on_request: RequestHook | None = None,
) -> MemoryStoreClient:
    """The client over `backend` in this process."""
    from memory_store.client_inprocess import InProcessMemoryStoreClient

    return InProcessMemoryStoreClient(
        backend, encoder=encoder, larimar=larimar, on_request=on_request
    )


def embedded_client(
    data_dir: str | os.PathLike[str],
    *,
    encoder: TextEncoder | Callable[[], TextEncoder] | None = None,
    larimar: LarimarConfig | None = None,
    on_request: RequestHook | None = None,
) -> MemoryStoreClient:
    """The in-process client over an `EmbeddedBackend` at `data_dir` (created if missing)."""
    return in_process_client(
        EmbeddedBackend(data_dir), encoder=encoder, larimar=larimar, on_request=on_request
    )


def http_client(
    base_url: str,
    *,
    timeout_s: float = 30.0,
    retry: RetryPolicy | None = None,
    on_request: RequestHook | None = None,
    transport: Any = None,
) -> MemoryStoreClient:
    """The client of a remote `longserve memory-store` at `base_url`."""
    from memory_store.client_http import HttpMemoryStoreClient

    return HttpMemoryStoreClient(
        base_url, timeout_s=timeout_s, retry=retry, on_request=on_request, transport=transport
    )


async def wait_until_ready(client: MemoryStoreClient, timeout_s: float = 10.0) -> None:
    """Poll `ping` until it succeeds or `timeout_s` passes (then re-raise StoreUnavailableError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.ping()
            return
        except StoreUnavailableError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.1)
