"""The per-tenant usage ledger on both backends (real Redis, real files): claims are atomic,
idempotent and refused past a limit without changing anything; release is the one decrement."""

from __future__ import annotations

import asyncio

import pytest

from memory_store.backends import Backend
from memory_store.errors import InvalidStoreRequest
from memory_store.usage import UsageLedger


@pytest.fixture(params=["embedded", "redis"])
def ledger(request: pytest.FixtureRequest) -> UsageLedger:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    return UsageLedger(backend)


async def test_claims_count_and_release_gives_back(ledger: UsageLedger) -> None:
    limits = {"sessions": 2}
    assert (await ledger.claim("t1", "sess_a", {"sessions": 1}, limits)).granted
    again = await ledger.claim("t1", "sess_a", {"sessions": 1}, limits)  # a retry: no change
    assert again.granted and again.totals == {"sessions": 1}
    assert (await ledger.claim("t1", "sess_b", {"sessions": 1}, limits)).granted
    refused = await ledger.claim("t1", "sess_c", {"sessions": 1}, limits)
    assert not refused.granted and refused.refused == "sessions"
    assert refused.totals == {"sessions": 2}  # the refused claim left nothing behind
    assert await ledger.totals("t2") == {}  # another tenant's ledger is its own

    assert await ledger.release("t1", "sess_a") == {"sessions": 1}
    assert await ledger.release("t1", "sess_a") == {"sessions": 1}  # twice: no change
    assert (await ledger.claim("t1", "sess_c", {"sessions": 1}, limits)).granted


async def test_amounts_replace_and_only_growth_is_checked(ledger: UsageLedger) -> None:
    limits = {"memory_tokens": 100}
    await ledger.claim("t", "sess_a", {"sessions": 1, "memory_tokens": 60}, limits)
    grown = await ledger.claim("t", "sess_a", {"memory_tokens": 90}, limits)
    assert grown.granted and grown.totals == {"sessions": 1, "memory_tokens": 90}
    over = await ledger.claim("t", "sess_b", {"sessions": 1, "memory_tokens": 20}, limits)
    assert over.refused == "memory_tokens" and over.totals == grown.totals
    # Over a limit lowered since: keeping or lowering an amount is still granted.
    assert (await ledger.claim("t", "sess_a", {"memory_tokens": 90}, {"memory_tokens": 10})).granted
    assert (await ledger.claim("t", "sess_a", {"memory_tokens": 50}, {"memory_tokens": 10})).granted
    assert await ledger.release("t", "sess_a") == {}


async def test_concurrent_claims_never_pass_the_limit(ledger: UsageLedger) -> None:
    limits = {"responses": 5, "response_bytes": 10_000}
    claims = await asyncio.gather(
        *(
            ledger.claim("t", f"resp_{i}", {"responses": 1, "response_bytes": 100}, limits)
            for i in range(20)
        )
    )
    assert sum(c.granted for c in claims) == 5
    assert await ledger.totals("t") == {"responses": 5, "response_bytes": 500}


async def test_bad_claims_are_refused_before_the_store(ledger: UsageLedger) -> None:
    for amounts in ({"sessions": -1}, {"no_such_kind": 1}, {"sessions": "1"}):
        with pytest.raises(InvalidStoreRequest):
            await ledger.claim("t", "sess_a", amounts)  # type: ignore[arg-type]
    with pytest.raises(InvalidStoreRequest):
        await ledger.claim("t/../x", "sess_a", {"sessions": 1})
    assert await ledger.totals("t") == {}
