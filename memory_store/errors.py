"""The memory store's one exception tree: every failure is a `StoreError`, raised `from` its cause.

server/ and engine/ catch these (and only import this module and `memory_store.client`).
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the memory store raises."""


class StoreUnavailableError(StoreError):
    """The backend (or the memory service) cannot be reached: refused, timed out. -> HTTP 503."""


class StoreFull(StoreUnavailableError):
    """The backend refused a write for want of memory (Redis at maxmemory, noeviction). -> 503
    `memory_store_full`: nothing was written; deletes still work."""


class NotFound(StoreError):
    """No value under this key. -> HTTP 404."""


class Conflict(StoreError):
    """The write collides with what is stored (e.g. create-only record exists). -> HTTP 409."""


class InvalidStoreRequest(StoreError, ValueError):
    """Malformed input: bad id, bad shapes, blob too large. -> HTTP 400 (413 for size)."""


def status_label(exc: BaseException | None) -> str:
    """The `status` label of `memory_store_requests_total` for an outcome."""
    if exc is None:
        return "ok"
    if isinstance(exc, NotFound):
        return "not_found"
    if isinstance(exc, StoreFull):
        return "full"
    if isinstance(exc, StoreUnavailableError):
        return "unavailable"
    if isinstance(exc, Conflict):
        return "conflict"
    if isinstance(exc, InvalidStoreRequest):
        return "invalid"
    return "error"
