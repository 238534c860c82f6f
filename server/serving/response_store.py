"""Stored responses of the Responses API (server/serving/responses.py), per tenant."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from server.errors import APIError
from server.protocol import ChatMessage


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object
    messages: list[ChatMessage]  # its conversation, instructions excluded, its answer included


class ResponseStore:
    """Stored responses, per tenant, an LRU of `limit` each (in this replica's memory)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_tenant: dict[str, collections.OrderedDict[str, StoredResponse]] = {}

    def get(self, tenant: str, response_id: str) -> StoredResponse:
        held = self._by_tenant.get(tenant)
        stored = held.get(response_id) if held is not None else None
        if stored is None:  # another tenant's id reads as unknown
            raise APIError(
                404,
                f"No response found with id '{response_id}'.",
                param="response_id",
                code="response_not_found",
            )
        return stored

    def put(self, tenant: str, stored: StoredResponse) -> None:
        held = self._by_tenant.setdefault(tenant, collections.OrderedDict())
        held[stored.body["id"]] = stored
        while len(held) > self.limit:
            held.popitem(last=False)

    def delete(self, tenant: str, response_id: str) -> None:
        self.get(tenant, response_id)
        del self._by_tenant[tenant][response_id]
