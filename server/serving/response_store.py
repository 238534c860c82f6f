"""Stored responses of the Responses API (server/serving/responses.py), per tenant.

Each replica keeps an LRU of its tenants' latest responses. With a memory store, every stored
response is also written there (namespace "tenant:T.responses", one record per response), so a
`previous_response_id` made on one replica continues on any other. The store write is best
effort: a response whose write failed stays in this replica only (logged). Each replica
bounds what it wrote: evicting from its LRU deletes the record too.
"""

from __future__ import annotations

import collections
import logging
import re
from dataclasses import dataclass
from typing import Any

from memory_store.client import MemoryStoreClient
from memory_store.errors import NotFound, StoreError
from server.errors import response_not_found
from server.protocol import ChatMessage

logger = logging.getLogger(__name__)

# What this server hands out (resp_ and 32 hex digits), with room for others' ids: anything
# else is unknown before it reaches the store, whose keys refuse it (a 500 before).
RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9]{1,120}")


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


class ResponseStore:
    """Stored responses, per tenant: an LRU of `limit` each here, written through to `store`."""

    def __init__(self, limit: int, store: MemoryStoreClient | None = None) -> None:
        self.limit = limit
        self.store = store
        self._by_tenant: dict[str, collections.OrderedDict[str, StoredResponse]] = {}
        self._local_only: set[tuple[str, str]] = set()  # held here, the store write failed

    @staticmethod
    def _namespace(tenant: str) -> str:
        return f"tenant:{tenant}.responses"

    async def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The stored response: the store's record is the truth (another replica may have
        deleted it); this replica's copy serves when the store cannot answer, or when the
        store never got it."""
        if not RESPONSE_ID.fullmatch(response_id):
            raise response_not_found(response_id[:130])
        held = self._by_tenant.get(tenant, collections.OrderedDict())
        local = held.get(response_id)
        if self.store is None or (tenant, response_id) in self._local_only:
            if local is None:
                raise response_not_found(response_id)  # another tenant's id reads as unknown too
            return local
        try:
            record = await self.store.get_record(self._namespace(tenant), response_id)
        except NotFound:
            held.pop(response_id, None)  # deleted through another replica
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
        held = self._by_tenant.setdefault(tenant, collections.OrderedDict())
        response_id = stored.body["id"]
        held[response_id] = stored
        evicted = []
        while len(held) > self.limit:
            evicted.append(held.popitem(last=False)[0])
            self._local_only.discard((tenant, evicted[-1]))
        if self.store is None:
            return
        try:
            if self.limit:
                await self.store.put_record(
                    self._namespace(tenant), response_id, stored.to_record()
                )
            for old in evicted:
                await self.store.delete_record(self._namespace(tenant), old)
        except StoreError as e:
            logger.warning("response %s kept in this replica only: %s", response_id, e)
            if response_id in held:
                self._local_only.add((tenant, response_id))

    async def delete(self, tenant: str, response_id: str) -> None:
        await self.get(tenant, response_id)  # 404 when unknown
        held = self._by_tenant.get(tenant)
        if held is not None:
            held.pop(response_id, None)
        self._local_only.discard((tenant, response_id))
        if self.store is not None:
            await self.store.delete_record(self._namespace(tenant), response_id)
