"""The per-tenant usage ledger on both backends (real Redis, real files): claims are atomic,
idempotent and refused past a limit without changing anything; release is the one decrement."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from memory_store.app import build_app
from memory_store.backends import Backend
from memory_store.errors import InvalidStoreRequest
from memory_store.settings import MemoryStoreSettings
from memory_store.usage import UsageLedger
from tests.memory_store.conftest import HashingEncoder


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


async def test_amounts_past_2_53_are_refused(ledger: UsageLedger) -> None:
    for amounts, limits in (({"sessions": 2**63}, None), ({"sessions": 1}, {"sessions": -1})):
        with pytest.raises(InvalidStoreRequest):
            await ledger.claim("t", "sess_a", amounts, limits)
    assert await ledger.totals("t") == {}


async def test_hostile_ledger_requests_over_http_are_clean_400s(tmp_path: Path) -> None:
    """The memory service's ledger routes: bad tenants, items, kinds and amounts are 400s in
    OpenAI's shape that name no server path, and change nothing."""
    app = build_app(MemoryStoreSettings(data_dir=str(tmp_path / "s")), encoder=HashingEncoder())
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://m") as http:
        bad = [
            ("/v1/usage/..%2Fetc/claim", {"item": "sess_a", "amounts": {"sessions": 1}}),
            ("/v1/usage/t/claim", {"item": "../x", "amounts": {"sessions": 1}}),
            ("/v1/usage/t/claim", {"item": "sess_a", "amounts": {"rm -rf": 1}}),
            ("/v1/usage/t/claim", {"item": "sess_a", "amounts": {"sessions": 10**30}}),
            ("/v1/usage/t/claim", {"item": "sess_a", "amounts": {"sessions": "x"}}),
            ("/v1/usage/t/claim", {"item": "sess_a", "amounts": {f"k{i}": 1 for i in range(99)}}),
            ("/v1/usage/t/release", {"item": "x" * 500}),
        ]
        for url, body in bad:
            response = await http.post(url, json=body)
            assert str(tmp_path) not in response.text and "Traceback" not in response.text
            if response.status_code == 404:  # "/" in a tenant: no such route
                assert "%2F" in url
                continue
            assert response.status_code == 400, (url, body, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
        usage = await http.get("/v1/usage/t")
        assert usage.status_code == 200 and usage.json()["totals"] == {}
        made = await http.post(
            "/v1/usage/t/claim",
            json={"item": "sess_a", "amounts": {"sessions": 1}, "limits": {"sessions": 1}},
        )
        assert made.json() == {"granted": True, "totals": {"sessions": 1}, "refused": None}
