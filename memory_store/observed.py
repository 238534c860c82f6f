"""Timing one memory-store operation and labelling its outcome.

The client's `on_request` hook and the service's Prometheus metrics see the same
`(op, backend, status, seconds)`; this module never imports prometheus_client.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from memory_store.errors import status_label

RequestHook = Callable[[str, str, str, float], None]
"""on_request(op, backend, status, seconds); status is "ok", "not_found", "unavailable", ..."""


@asynccontextmanager
async def observed(hook: RequestHook | None, op: str, backend: str) -> AsyncIterator[None]:
    """Time the block and report it to `hook` (if any) with its outcome, even when it raises."""
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:
        error = e
        raise
    finally:
        if hook is not None:
            hook(op, backend, status_label(error), time.perf_counter() - start)
