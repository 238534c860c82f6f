"""The per-tenant usage ledger: what each tenant holds in the store, counted in the store, so
that a limit holds however many replicas serve the tenant and whichever one it picks.

The ledger is a set of items per tenant (a session, a stored response), each holding amounts
of some kinds (`KINDS`: 1 session, 3 documents of 40 KB and 9,000 memory tokens...), and the
tenant's totals per kind. `claim` sets an item's amounts and `release` drops the item, each in
one atomic step (a Lua script on Redis, a locked file update in the embedded store), so:

- a claim is idempotent: claiming an item again at the same amounts changes nothing (a retry,
  a restore of a session already counted), and its new amounts replace its old ones;
- a claim that would take a total past its limit changes nothing and says which limit
  (`UsageClaim.refused`); a claim that keeps or lowers a total is always granted;
- `release` is the one decrement: deleting, expiring and sweeping a session or a response all
  call it with the item's id, and releasing an item the ledger does not hold changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memory_store.backends.base import Backend
from memory_store.backends.embedded import EmbeddedBackend
from memory_store.backends.redis import RedisBackend
from memory_store.errors import InvalidStoreRequest, StoreError
from memory_store.keys import KeySpace, redis_key, validate_id

# Everything the ledger counts, per tenant.
KINDS = (
    "sessions",  # 1 per session
    "documents",  # a session's documents
    "document_bytes",  # their extracted texts, as stored
    "memory_tokens",  # the tokens a session's memory holds
    "responses",  # 1 per stored response
    "response_bytes",  # a stored response's record, as encoded
    "prefix_entries",  # prefix-store entries
)
# Kinds that are bytes the tenant holds in the store (the `tenant_stored_bytes` metric).
BYTE_KINDS = ("document_bytes", "response_bytes")
# Amounts and limits stay exact in Lua's doubles and in Redis's 64-bit counters.
MAX_AMOUNT = 2**53


@dataclass(frozen=True)
class UsageClaim:
    """`granted`, or `refused` names the kind whose limit it would pass; `totals` are the
    tenant's totals after the claim (as they stand when refused)."""

    granted: bool
    totals: dict[str, int] = field(default_factory=dict)
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"granted": self.granted, "totals": self.totals, "refused": self.refused}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UsageClaim:
        totals = {str(k): int(v) for k, v in dict(data["totals"]).items()}
        refused = data.get("refused")
        return cls(bool(data["granted"]), totals, None if refused is None else str(refused))


def check_amounts(
    amounts: Mapping[str, int], limits: Mapping[str, int] | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """Validated copies of a claim's amounts (known kinds, >= 0) and limits (known kinds)."""
    out: dict[str, int] = {}
    for kind, amount in amounts.items():
        if kind not in KINDS or isinstance(amount, bool) or not isinstance(amount, int):
            raise InvalidStoreRequest(f"invalid usage amount {kind!r}: {amount!r}")
        if not 0 <= amount <= MAX_AMOUNT:
            raise InvalidStoreRequest(f"usage amount {kind!r} must be in 0..2**53")
        out[kind] = amount
    bounds: dict[str, int] = {}
    for kind, limit in (limits or {}).items():
        if kind not in KINDS or isinstance(limit, bool) or not isinstance(limit, int):
            raise InvalidStoreRequest(f"invalid usage limit {kind!r}: {limit!r}")
        if not 0 <= limit <= MAX_AMOUNT:
            raise InvalidStoreRequest(f"usage limit {kind!r} must be in 0..2**53")
        bounds[kind] = limit
    return out, bounds


def stored_bytes(totals: Mapping[str, int]) -> int:
    return sum(int(totals.get(kind, 0)) for kind in BYTE_KINDS)


def prefix_entry_item(fingerprint: str, chain_hash: str) -> str:
    """The ledger item of one prefix-store chunk (engine/caches/prefix_store.py): claimed by
    the engine before it writes the chunk; whatever deletes the chunk releases it."""
    return f"prefix.{fingerprint[:24]}.{chain_hash[:40]}"


# KEYS: items, totals. ARGV: mode, item, then per kind: kind, amount, limit (-1: none).
# Item amounts are fields "<item>/<kind>" of `items`; `totals` holds each kind's sum.
# Checks first, then writes: a refused claim changes nothing. Returns
# {granted 0|1, refused kind or '', HGETALL totals...}.
_LEDGER = """
local items, totals, mode, item = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
if mode == 'claim' then
  for i = 3, #ARGV, 3 do
    local kind, amount, limit = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local old = tonumber(redis.call('HGET', items, item .. '/' .. kind) or '0')
    local total = tonumber(redis.call('HGET', totals, kind) or '0')
    if limit >= 0 and amount > old and total - old + amount > limit then
      local out = {0, kind}
      for _, v in ipairs(redis.call('HGETALL', totals)) do out[#out + 1] = v end
      return out
    end
  end
  for i = 3, #ARGV, 3 do
    local kind, amount = ARGV[i], tonumber(ARGV[i + 1])
    local old = tonumber(redis.call('HGET', items, item .. '/' .. kind) or '0')
    if amount > 0 then
      redis.call('HSET', items, item .. '/' .. kind, amount)
    else
      redis.call('HDEL', items, item .. '/' .. kind)
    end
    if amount ~= old then redis.call('HINCRBY', totals, kind, amount - old) end
  end
elseif mode == 'release' then
  for i = 3, #ARGV do
    local old = redis.call('HGET', items, item .. '/' .. ARGV[i])
    if old then
      redis.call('HDEL', items, item .. '/' .. ARGV[i])
      redis.call('HINCRBY', totals, ARGV[i], -tonumber(old))
    end
  end
end
local out = {1, ''}
for _, v in ipairs(redis.call('HGETALL', totals)) do out[#out + 1] = v end
return out
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class UsageLedger:
    """The ledger over a backend (Redis: one script per step; embedded: one locked file
    update per step)."""

    FILE = "usage.json"

    def __init__(self, backend: Backend) -> None:
        if not isinstance(backend, RedisBackend | EmbeddedBackend):
            raise StoreError(f"no usage ledger for the {backend.name} backend")
        self.backend = backend

    async def claim(
        self,
        tenant: str,
        item: str,
        amounts: Mapping[str, int],
        limits: Mapping[str, int] | None = None,
    ) -> UsageClaim:
        """Set `item`'s amounts (kinds not named keep theirs) unless a total that grows would
        pass its limit in `limits`."""
        tag = KeySpace.usage_tag(tenant)
        validate_id(item, "usage item")
        amounts, bounds = check_amounts(amounts, limits)
        if isinstance(self.backend, RedisBackend):
            args: list[Any] = ["claim", item]
            for kind, amount in amounts.items():
                args += [kind, amount, bounds.get(kind, -1)]
            return self._answer(await self._script(tag, args))
        return await self.backend.update_json(
            tag, self.FILE, lambda state: _claim(state, item, amounts, bounds)
        )

    async def release(self, tenant: str, item: str) -> dict[str, int]:
        """Drop `item` and its amounts from the tenant's totals (nothing when not held);
        returns the totals after."""
        tag = KeySpace.usage_tag(tenant)
        validate_id(item, "usage item")
        if isinstance(self.backend, RedisBackend):
            return self._answer(await self._script(tag, ["release", item, *KINDS])).totals
        return await self.backend.update_json(tag, self.FILE, lambda state: _release(state, item))

    async def totals(self, tenant: str) -> dict[str, int]:
        tag = KeySpace.usage_tag(tenant)
        if isinstance(self.backend, RedisBackend):
            return self._answer(await self._script(tag, ["read", "-"])).totals
        return await self.backend.update_json(tag, self.FILE, _totals)

    async def _script(self, tag: str, args: list[Any]) -> Any:
        assert isinstance(self.backend, RedisBackend)
        keys = [redis_key(tag, "usage", "items"), redis_key(tag, "usage", "totals")]
        return await self.backend.run_script("usage", _LEDGER, keys, args)

    @staticmethod
    def _answer(raw: list[Any]) -> UsageClaim:
        granted, refused, *flat = raw
        totals = {_text(k): int(_text(v)) for k, v in zip(flat[::2], flat[1::2], strict=True)}
        refused_kind = _text(refused) or None
        return UsageClaim(bool(int(granted)), _nonzero(totals), refused_kind)


# The embedded store's steps, on the ledger file's state {"items": {item: {kind: n}}, "totals"}.


def _nonzero(totals: Mapping[str, int]) -> dict[str, int]:
    return {k: int(v) for k, v in totals.items() if int(v)}


def _claim(
    state: dict[str, Any], item: str, amounts: dict[str, int], limits: dict[str, int]
) -> UsageClaim:
    items: dict[str, dict[str, int]] = state.setdefault("items", {})
    totals: dict[str, int] = state.setdefault("totals", {})
    held = items.get(item, {})
    for kind, amount in amounts.items():
        old, total = held.get(kind, 0), totals.get(kind, 0)
        limit = limits.get(kind, -1)
        if limit >= 0 and amount > old and total - old + amount > limit:
            return UsageClaim(False, _nonzero(totals), kind)
    held = dict(held)
    for kind, amount in amounts.items():
        totals[kind] = totals.get(kind, 0) + amount - held.get(kind, 0)
        if amount:
            held[kind] = amount
        else:
            held.pop(kind, None)
    if held:
        items[item] = held
    else:
        items.pop(item, None)
    return UsageClaim(True, _nonzero(totals))


def _release(state: dict[str, Any], item: str) -> dict[str, int]:
    totals: dict[str, int] = state.setdefault("totals", {})
    for kind, amount in state.setdefault("items", {}).pop(item, {}).items():
        totals[kind] = totals.get(kind, 0) - amount
    return _nonzero(totals)


def _totals(state: dict[str, Any]) -> dict[str, int]:
    return _nonzero(state.get("totals", {}))
