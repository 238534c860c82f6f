"""Stored responses of the Responses API (server/serving/responses.py), per tenant.

Each replica keeps an LRU of its tenants' latest responses. With a memory store, every stored
response is also written there (namespace "tenant:T.responses", one record per response), so a
`previous_response_id` made on one replica continues on any other. The store write is best
effort: a response whose write failed stays in this replica only (logged). Each replica
bounds what it wrote: evicting from its LRU deletes the record too.

Their bytes are bounded per tenant across replicas (`max_bytes`, counted in the store's usage
ledger as the encoded record's size, each replica's own figure as a floor): past it a
store=true request is a 429 naming the limit; nothing is evicted for it (decision 058).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memory_store.client import MemoryStoreClient
from memory_store.errors import NotFound, StoreError
from server.errors import APIError, limit_reached, response_not_found
from server.protocol import ChatMessage

logger = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object
    messages: list[ChatMessage]  # its conversation, instructions excluded, its answer included

    def to_record(self) -> dict[str, Any]:
        return {"body": self.body, "messages": [m.model_dump() for m in self.messages]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StoredResponse:
        messages = [ChatMessage.model_validate(m) for m in record["messages"]]
        return cls(body=dict(record["body"]), messages=messages)


def encoded_size(record: dict[str, Any]) -> int:
    """The bytes a record takes in the store (its compact JSON, as the backends write it)."""
    return len(json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


class ResponseStore:
    """Stored responses, per tenant: an LRU of `limit` each here, written through to `store`,
    at most `max_bytes` per tenant across replicas."""

    def __init__(
        self,
        limit: int,
        store: MemoryStoreClient | None = None,
        *,
        max_bytes: int = 64 * 1024**2,
        on_totals: Callable[[str, dict[str, int]], None] | None = None,
    ) -> None:
        self.limit = limit
        self.store = store
        self.max_bytes = max_bytes
        self.on_totals = on_totals or (lambda tenant, totals: None)
        self._by_tenant: dict[str, collections.OrderedDict[str, StoredResponse]] = {}
        self._sizes: dict[str, dict[str, int]] = {}  # per tenant: bytes of each held here
        self._local_only: set[tuple[str, str]] = set()  # held here, the store write failed

    def _full(self, used: int, needed: int) -> APIError:
        return limit_reached(
            "stored_response_limit",
            f"This API key's stored responses hold {used} bytes and this one needs {needed}; "
            f"the most allowed is {self.max_bytes} (max_stored_response_bytes_per_tenant). "
            "Delete some (DELETE /v1/responses/{id}) or send store=false.",
        )

    def _held_here(self, tenant: str) -> int:
        """Bytes only this replica knows of: all it holds without a store, else those whose
        store write failed (the ledger counts the rest, deletions by other replicas too)."""
        sizes = self._sizes.get(tenant, {})
        if self.store is None:
            return sum(sizes.values())
        return sum(n for rid, n in sizes.items() if (tenant, rid) in self._local_only)

    async def check_room(self, tenant: str, needed: int) -> None:
        """429 when `needed` more bytes (what the request is sure to store: its conversation)
        would not fit the tenant's `max_bytes`; checked before the request runs, so a full
        tenant's request costs no generation."""
        used = self._held_here(tenant)
        if self.store is not None:
            try:
                totals = await self.store.usage(tenant)
                self.on_totals(tenant, totals)
                used = max(used, totals.get("response_bytes", 0))
            except StoreError as e:
                logger.info("usage of tenant %s unknown, this replica's counts: %s", tenant, e)
        if used + needed > self.max_bytes:
            raise self._full(used, needed)

    @staticmethod
    def _namespace(tenant: str) -> str:
        return f"tenant:{tenant}.responses"

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The stored response: the store's record is the truth (another replica may have
        deleted it); this replica's copy serves when the store cannot answer, or when the
        store never got it."""
        held = self._by_tenant.get(tenant, collections.OrderedDict())
        local = held.get(response_id)
        if self.store is None or (tenant, response_id) in self._local_only:
            if local is None:
                raise response_not_found(response_id)  # another tenant's id reads as unknown too
            return local
        if not response_id.startswith("resp_"):
            raise response_not_found(response_id)
        try:
            record = await self.store.get_record(self._namespace(tenant), response_id)
        except NotFound:
            held.pop(response_id, None)  # deleted through another replica
            self._sizes.get(tenant, {}).pop(response_id, None)
            raise response_not_found(response_id) from None
        except StoreError:
            if local is None:
                raise
            return local
        try:
            return StoredResponse.from_record(record)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("stored response %s is unreadable: %s", response_id, e)
            raise response_not_found(response_id) from e

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        """Keep `stored`; 429 (and nothing kept) when it would take the tenant past
        `max_bytes`."""
        response_id = stored.body["id"]
        record = stored.to_record()
        size = encoded_size(record)
        sizes = self._sizes.setdefault(tenant, {})
        here = self._held_here(tenant) + size
        if here > self.max_bytes:
            raise self._full(here - size, size)
        claimed = False
        if self.store is not None and self.limit:
            try:
                result = await self.store.claim_usage(
                    tenant,
                    response_id,
                    {"responses": 1, "response_bytes": size},
                    {"response_bytes": self.max_bytes},
                )
                self.on_totals(tenant, result.totals)
                if not result.granted:
                    raise self._full(result.totals.get("response_bytes", 0), size)
                claimed = True
            except StoreError as e:
                logger.info("response %s not counted in the store: %s", response_id, e)
        held = self._by_tenant.setdefault(tenant, collections.OrderedDict())
        held[response_id] = stored
        sizes[response_id] = size
        evicted = []
        while len(held) > self.limit:
            evicted.append(held.popitem(last=False)[0])
            sizes.pop(evicted[-1], None)
            self._local_only.discard((tenant, evicted[-1]))
        if self.store is None:
            return
        try:
            if self.limit:
                await self.store.put_record(self._namespace(tenant), response_id, record)
            for old in evicted:
                await self._forget(tenant, old)
        except StoreError as e:
            logger.warning("response %s kept in this replica only: %s", response_id, e)
            if response_id in held:
                self._local_only.add((tenant, response_id))
                if claimed:  # not in the store: not counted there either (best effort)
                    with contextlib.suppress(StoreError):
                        await self.store.release_usage(tenant, response_id)

    async def _forget(self, tenant: str, response_id: str) -> None:
        """The stored record, then its count in the ledger: every deletion goes through
        here."""
        assert self.store is not None
        await self.store.delete_record(self._namespace(tenant), response_id)
        self.on_totals(tenant, await self.store.release_usage(tenant, response_id))

    async def delete(self, tenant: str, response_id: str) -> None:
        await self.get(tenant, response_id)  # 404 when unknown
        held = self._by_tenant.get(tenant)
        if held is not None:
            held.pop(response_id, None)
        self._sizes.get(tenant, {}).pop(response_id, None)
        self._local_only.discard((tenant, response_id))
        if self.store is not None:
            await self._forget(tenant, response_id)
